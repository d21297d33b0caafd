"""The draft's own contract beyond what the replies show: its prefill never runs the expansion
step's compiled forward (a GPU compiles the draft for its captured step, one fixed shape); a
step over a long window attends in blocks, as the masked attention does."""

from __future__ import annotations

import pytest
import torch

from sfchat.config import Settings
from sfchat.engine import draft
from sfchat.engine.draft import Drafter
from sfchat.model import attention
from sfchat.model.decoder import n_layers
from sfchat.model.kv import Blocks
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.node.head import Head
from sfchat.protocol.wire import Sampling


def test_the_drafts_prefill_runs_the_plain_forward_not_the_steps_compiled_one(zoo):
    """Found: a GPU compiles the draft (``capture(compile=True)``, the default) for its expansion
    step, and the prefill of each reply's new context ran that compiled forward too: every new
    length compiled anew (8-11 s each for a tiny model on this machine's CPU; dynamic=False), and
    past dynamo's recompile limit it fell back to eager or, with --compile-attention's strict
    limits, raised mid-reply. The prefill is a plain forward now; the step's proposals are the
    same as before."""
    s = Settings(model=str(zoo["qwen2-untied"]), draft=str(zoo["draft"]), k=4, device="cpu")
    head = Head.open(s)
    drafter = head.engine.drafter
    plain, calls = drafter.forward, []

    def step_forward(*args, **kw):  # stands for the compiled one: the expansion step may use it
        calls.append(args[0].shape[0])
        return plain(*args, **kw)

    drafter.forward = step_forward
    for n in (37, 52, 70):  # prompts of three lengths: three prefills of new shapes
        drafter.sync(list(range(3, 3 + n)))
        assert calls == [], f"the prefill ran the step's forward on {calls} rows"
        proposals = drafter.expand([(9, n, "a", [])], Sampling())
        assert calls == [drafter.rows] and len(proposals[0]) == drafter.children
        calls.clear()
        drafter.scratch.release("a")
    head.close()
    fresh = Head.open(s).engine.drafter  # the same context fed by the plain forward throughout
    fresh.sync(list(range(3, 3 + 70)))
    assert fresh.expand([(9, 70, "a", [])], Sampling()) == proposals


def drafter(path, blocks_from: int) -> Drafter:
    src = ModelSource.open(str(path))
    model = ModelSlice.load(src, 0, n_layers(src.config), embed=True, head=True, dtype=torch.float32,
                            device=torch.device("cpu"), max_len=1280)  # windows 512, 1024, 1280
    return Drafter(model, width=4, children=6, pool=64, blocks_from=blocks_from)


def tree_rows(context: int) -> list:
    """A step's rows: a path of three nodes and a sibling under its first."""
    return [(11, context, "a", []), (29, context + 1, "b", ["a"]), (7, context + 2, "c", ["a", "b"]),
            (31, context + 1, "d", ["a"])]


@pytest.mark.parametrize("family", ["qwen2-untied", "llama-tied"])
def test_a_step_over_a_long_window_attends_in_blocks_as_the_masked_attention_does(zoo, family, monkeypatch):
    """A step over a window of ``blocks_from`` slots or more (a multiple of ``BLOCK``) runs its
    attention in blocks of ``BLOCK`` merged by log-sum-exp; its proposals are the masked (SDPA)
    attention's to float32 rounding. A shorter window, and the prefill's plain forwards, keep SDPA."""
    calls = []
    blocked = attention.in_blocks

    def spy(query, key, value, how, scale):
        calls.append((query.shape[2], key.shape[2], how.block))
        return blocked(query, key, value, how, scale)

    monkeypatch.setattr(attention, "in_blocks", spy)
    plain, blocks = drafter(zoo[family], 0), drafter(zoo[family], 1024)
    layers = n_layers(blocks.model.config)
    tokens = [3 + (i * 37) % 250 for i in range(900)]
    for context in (300, 900):  # windows 512 (SDPA both) and 1024 (blocks for one)
        for d in (plain, blocks):
            d.sync(tokens[:context])
        calls.clear()
        for s in (Sampling(), Sampling(temperature=0.8, top_k=20)):  # greedy, and the sampled step's graph
            a = plain.expand(tree_rows(context), s)
            assert calls == []
            b = blocks.expand(tree_rows(context), s)
            assert calls == ([] if context == 300 else [(blocks.rows, 1024, draft.BLOCK)] * layers)
            calls.clear()
            for row_a, row_b in zip(a, b, strict=True):
                assert [t for t, _ in row_a] == [t for t, _ in row_b]
                assert [p for _, p in row_a] == pytest.approx([p for _, p in row_b], rel=1e-4, abs=1e-6)
        for d in (plain, blocks):
            for key in "abcd":
                d.scratch.release(key)


def test_in_blocks_weighs_a_block_a_row_sees_nothing_of_by_nothing():
    """``attention.in_blocks`` against the float32 masked attention, where most rows see nothing in
    most blocks (the bias the dtype's lowest there): every row equals its reference."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, n, window, dim = 4, 2, 5, 512, 8
    q, k, v = (torch.randn(1, h, t, dim, generator=g) for h, t in ((heads, n), (kv_heads, window), (kv_heads, window)))
    visible = torch.zeros(n, window, dtype=torch.bool)
    for r in range(n):
        visible[r, : 40 * r + 1] = True  # row 0 sees one slot; none sees the last block
        visible[r, 300 + r] = True
    bias = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    out = attention.in_blocks(q, k, v, Blocks(bias.repeat(heads // kv_heads, 1), 128), dim ** -0.5)
    group = heads // kv_heads
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * dim ** -0.5 + bias
    ref = (scores.softmax(-1) @ v.repeat_interleave(group, 1)).transpose(1, 2)
    assert out.shape == ref.shape == (1, n, heads, dim)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
