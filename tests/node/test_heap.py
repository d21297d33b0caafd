"""A node's heap after loading: frozen out of the collector's scans on a GPU; full collections timed."""

from __future__ import annotations

import gc

from sfchat.config import Settings
from sfchat.node import heap
from sfchat.node.head import Head


def test_settle_collects_then_freezes_what_is_alive():
    class Cycle:
        pass

    kept, dead = Cycle(), Cycle()
    kept.me, dead.me = kept, dead
    del dead  # garbage in a cycle: settle collects it rather than freezing it for good
    before = gc.get_freeze_count()
    try:
        heap.settle()
        assert gc.get_freeze_count() > before
        assert sum(type(o) is Cycle for o in gc.get_objects()) == 0  # frozen ones are not listed: kept is
        gc.unfreeze()
        assert sum(type(o) is Cycle for o in gc.get_objects()) == 1  # kept, alive; the cycle was collected
    finally:
        gc.unfreeze()


def test_full_collections_are_timed_until_stopped():
    watch = heap.FullCollections()
    try:
        gc.collect(0)
        gc.collect(1)  # younger generations do not count
        assert watch.ms == []
        gc.collect()
        gc.collect()
        assert len(watch.ms) == 2 and all(ms >= 0 for ms in watch.ms)
    finally:
        out = watch.stop()
    gc.collect()
    assert len(out) == 2 and watch._observe not in gc.callbacks


def test_a_cpu_head_and_its_local_tail_leave_the_heap_as_it_is(zoo, monkeypatch):
    """Only a GPU node settles (a process that loads model after model, as the CPU tests do, would
    keep every frozen cycle for good)."""
    calls = []
    monkeypatch.setattr(heap, "settle", lambda: calls.append(1))
    session = Head.open(Settings(model=str(zoo["qwen2-untied"]), draft=str(zoo["draft"]), k=2, device="cpu"))
    assert session.engine.link is not None and calls == []


def test_a_tail_thaws_a_settled_heap_before_it_loads_another_model(zoo):
    """A settled tail (a GPU's) whose next head names another model: the model it let go is freed
    whole, its cycles too, before the next is loaded (frozen, a cycle would hold its memory for good)."""
    import torch

    from sfchat.node.tail_loader import TailLoader
    from sfchat.protocol.handshake import Hello

    class Held:  # stands for the model let go: an object in a cycle, alive when the heap was settled
        pass

    held = Held()
    held.me = held
    heap.settle()
    del held
    try:
        assert gc.get_freeze_count() > 0
        hello = Hello(model=str(zoo["qwen2-untied"]), revision=None, split=2, dtype="float32", max_len=64,
                      n_layers=4, hidden_size=64, frames=(9,), graphs=False)
        model = TailLoader(torch.device("cpu"))(hello, lambda *a: None)
        assert model.config.hidden_size == 64
        assert gc.get_freeze_count() == 0 and not any(type(o) is Held for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_thaw_leaves_a_heap_nobody_froze_alone(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    heap.thaw()
    assert collected == [] and gc.get_freeze_count() == 0
