"""The scratch slots of live nodes: who holds which, and what a commit moves, in every segment."""

from __future__ import annotations

import pytest
import torch

from sfchat.engine.scratch import Scratch


class Slots:
    """A stand-in for a slice's K/V: what each slot holds, as ``move`` and ``note`` leave it."""

    def __init__(self, n: int) -> None:
        self.held: list[object] = [None] * n
        self.written: list[int] = []

    def move(self, src, dst) -> None:
        values = [self.held[s] for s in src]  # every source read before any destination is written
        for d, v in zip(dst, values):
            self.held[d] = v

    def note(self, start, tokens) -> None:
        assert start <= len(self.written)
        del self.written[start:]
        self.written.extend(tokens)


def write(model: Slots, scratch: Scratch, key) -> int:
    slot = scratch.take(key)
    model.held[slot] = key  # a forward wrote the key's K/V at its slot
    return slot


def test_a_commit_moves_the_committed_keys_into_the_context_and_the_covered_ones_out_of_its_way():
    model = Slots(32)
    model.note(0, list(range(10)))
    scratch = Scratch(model, 6)  # slots 10..14, 15 the trash slot
    scratch.reset(10)
    assert [write(model, scratch, k) for k in "abcde"] == [10, 11, 12, 13, 14]
    assert scratch.take("f") is None and scratch.trash == 15 and scratch.free == 0
    scratch.release("d")
    scratch.commit(["c", "e"], [100, 101])  # a and b are live and in the way of the context's growth
    assert scratch.n == 12 and model.held[10:12] == ["c", "e"] and model.written == list(range(10)) + [100, 101]
    for key in "ab":  # moved, K/V and all, to free slots after the new context
        assert 12 <= scratch.slot(key) < 17 and model.held[scratch.slot(key)] == key
    assert scratch.slot("c") is None and "c" not in scratch and scratch.trash == 17 and scratch.free == 3
    assert len({scratch.slot("a"), scratch.slot("b")}) == 2
    assert scratch.take("x") not in (scratch.slot("a"), scratch.slot("b"))


def test_a_taken_slot_is_the_lowest_free_one_and_a_key_keeps_its_own():
    scratch = Scratch(Slots(16), 5)
    scratch.reset(3)
    assert scratch.take("a") == 3 and scratch.take("a") == 3 and scratch.take("b") == 4
    scratch.release("a")
    assert scratch.take("c") == 3 and scratch.end == 8
    with pytest.raises(ValueError, match="2 slots committed with 1 tokens"):
        scratch.commit(["b", "c"], [1])
    with pytest.raises(ValueError, match="at least one slot"):
        Scratch(Slots(4), 1)


def test_tree_inputs_write_each_row_at_its_slot_seeing_its_ancestors_and_pad_to_the_trash_slot():
    scratch = Scratch(Slots(32), 6)
    scratch.reset(20)
    rows = [(20, "r", []), (21, "x", ["r"]), (21, "y", ["r"]), (22, "z", ["r", "y"])]
    slots, mask = scratch.tree_inputs(rows, 6, torch.device("cpu"))
    assert slots.tolist() == [20, 21, 22, 23, 25, 25]
    assert mask.rope.tolist() == [20, 21, 21, 22, 19, 19] and mask.base.tolist() == [20]
    assert mask.visible.int().tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="do not fit"):
        scratch.tree_inputs(rows, 3, torch.device("cpu"))
