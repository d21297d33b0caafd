"""Canonical attention (a one-shape slice's, ``model.attention``).

On a CPU a masked attention row comes out the same bits wherever its keys sit, so comparing
outputs here would show nothing of what moves a GPU's rounding. These tests check what the
kernels receive instead: for one row (a node deep in a path), whatever frame it is computed in
(its siblings, padding, the row order), whatever slots its ancestors hold in the scratch and
however far the context was committed when it ran, the kernels get the same query, the same
context keys at the same slots and the same own keys in the same order; and canonical attention
equals transformers' masked attention to float32 rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

from sfchat.engine.scratch import Scratch
from sfchat.model import attention, kv
from sfchat.model.kv import RowKeys
from sfchat.model.decoder import n_layers
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource

CPU = torch.device("cpu")
SPAN, ROWS, MAX_LEN = 8, 8, 64
IDS = [3, 17, 42, 99, 5, 250, 7, 11, 13, 19, 23, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97]
TARGET = len(IDS) - 1  # the row under test: position 25, its path the positions before it


@pytest.fixture(autouse=True)
def short_span(monkeypatch):
    monkeypatch.setattr(kv, "SPAN", SPAN)  # rows past the span read a context part: short prompts exercise it
    monkeypatch.setattr(kv, "BLOCK", 16)  # and it runs in several blocks, most of them empty for a row


def load(path, dtype, rows=ROWS, device=CPU, max_len=MAX_LEN):
    src = ModelSource.open(str(path))
    return ModelSlice.load(src, 0, n_layers(src.config), embed=True, head=False, dtype=dtype, device=device,
                           max_len=max_len, rows=rows)


def target_row(sl: ModelSlice, committed: int, seed: int, shape: int = ROWS) -> tuple[torch.Tensor, int]:
    """The hidden state of the row at position ``TARGET`` after a context of ``committed``
    positions (fed through ``feed``), the path's other positions computed as a frame's nodes among
    siblings, in slots scrambled by other keys, the row itself among siblings and padding rows, in
    a shuffled order: (its output, its row in the last forward)."""
    rng = random.Random(seed)
    sl.reset(zero=True)
    if committed:
        sl.feed(torch.tensor(IDS[:committed]), 0, chunk=shape)
        sl.note(0, IDS[:committed])
    scratch = Scratch(sl, 24)
    scratch.reset(committed)
    for j in range(rng.randrange(4)):  # slots held by others: the path's slots move
        scratch.take(("other", j))
    path = [("path", p) for p in range(committed, TARGET)]

    def frame(rows):
        rng.shuffle(rows)
        rows.sort(key=lambda row: row[0])  # ancestors first, as a frame sends them; siblings shuffled
        slots, mask = scratch.tree_inputs(rows, shape, CPU)
        ids = [IDS[p] if key[0] == "path" else rng.randrange(300) for p, key, _ in rows]
        ids += [rng.randrange(300) for _ in range(shape - len(rows))]  # what padding rows hold is anyone's
        out = sl.run(torch.tensor(ids), slots, end=scratch.reach, tree=mask)
        return {key: (out[r], r) for r, (_, key, _) in enumerate(rows)}

    if path:
        siblings = [(p, ("sib", p), path[:p - committed]) for p in range(committed, TARGET) if rng.random() < 0.5]
        frame([(p, key, path[:i]) for i, (_, p) in enumerate(path) for key in [("path", p)]]
              + siblings[:shape - len(path)])
    me = (TARGET, ("path", TARGET), path)
    others = [(TARGET, ("sib", TARGET, j), path) for j in range(rng.randrange(shape - 1))]
    return frame([me] + others)[("path", TARGET)]


def kernel_inputs(monkeypatch) -> list:
    """Every call of canonical attention from now on: (query, key, value, how)."""
    calls = []
    real = attention.canonical

    def recorded(query, key, value, how, scale):
        calls.append((query, key.clone(), value.clone(), how))
        return real(query, key, value, how, scale)

    monkeypatch.setattr(attention, "canonical", recorded)
    return calls


def what_a_row_reads(call, r: int) -> list[torch.Tensor]:
    """What the kernels get for row ``r`` of a call: its query, the context part's keys and values
    (the slots its bias lets through, in slot order: their slots too), its own keys and values in
    the order they are summed."""
    query, key, value, how = call
    ctx = (how.bias[r] == 0).nonzero().flatten()
    own = how.keys[r][how.own[r] == 0]
    return [query[0, :, r], ctx, key[0][:, ctx], value[0][:, ctx], key[0][:, own], value[0][:, own]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2-untied", "qwen3-tied", "llama-untied"])
def test_a_row_reaches_the_kernels_alike_whatever_its_frame_its_slots_and_the_committed_context(
        zoo, monkeypatch, family, dtype):
    sl = load(zoo[family], dtype)
    runs = []
    for committed, seed in [(TARGET - SPAN + 1, 0), (TARGET - SPAN + 1, 1), (TARGET - 3, 2), (TARGET - 1, 3),
                            (TARGET, 4), (TARGET - 5, 5)]:
        calls = kernel_inputs(monkeypatch)
        out, r = target_row(sl, committed, seed)
        layers = calls[-len(sl.layers):]  # the last forward's, one call per layer
        runs.append((out, [what_a_row_reads(c, r) for c in layers]))
        assert len(runs[-1][1][0][1]) == TARGET - SPAN + 1  # the context part: every position below its span
    first_out, first_reads = runs[0]
    for out, reads in runs[1:]:
        for a, b in zip(first_reads, reads):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(out, first_out)


@pytest.mark.parametrize("family", ["qwen2-untied", "qwen3-tied", "llama-tied"])
def test_canonical_attention_is_the_masked_attention_to_float32_rounding(zoo, family):
    canonical, masked = load(zoo[family], torch.float32), load(zoo[family], torch.float32, rows=None)
    for committed, seed in [(TARGET - SPAN + 1, 0), (TARGET - 2, 1), (TARGET, 2), (TARGET - 6, 3)]:
        a = target_row(canonical, committed, seed)[0]
        b = target_row(masked, committed, seed, shape=TARGET - committed + ROWS)[0]
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-3), (a - b).abs().max()  # magnitudes up to ~70
    # a plain forward (a prefill's pieces, padded) too
    ids = torch.tensor(IDS)
    canonical.reset(zero=True)
    masked.reset(zero=True)
    a, b = canonical.feed(ids, 0), masked.feed(ids, 0)
    assert a.shape == b.shape == (len(IDS), canonical.config.hidden_size)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-3), (a - b).abs().max()  # magnitudes up to ~70


def test_a_row_past_the_span_is_refused_and_one_at_its_edge_reads_its_whole_span(zoo):
    sl = load(zoo["qwen2-untied"], torch.float32)
    scratch = Scratch(sl, 24)
    scratch.reset(4)
    path = [(p, ("n", p)) for p in range(4, 4 + SPAN)]
    with pytest.raises(ValueError, match=f"not within {SPAN - 1} positions past the context of 4"):
        scratch.tree_inputs([(4 + SPAN, "deep", [k for _, k in path])], ROWS, CPU)
    for _, key in path:
        scratch.take(key)
    _, keys = scratch.tree_inputs([(3 + SPAN, "edge", [k for _, k in path[:-1]])], ROWS, CPU)
    assert keys.keys[0].tolist() == [scratch.slot(k) for _, k in path[:-1]] + [scratch.slot("edge")]
    assert keys.keys[1:].tolist() == [[-1] * (SPAN - 1) + [scratch.trash]] * (ROWS - 1)
    early = RowKeys(torch.tensor([2]), torch.tensor([[-1] * (SPAN - 3) + [0, 1, 2]]))
    assert torch.equal(kv.causal_keys(torch.tensor([2])), early.keys)


def test_a_row_without_a_context_part_ignores_what_a_fused_kernel_reports_for_it(zoo, monkeypatch):
    """The H100's memory-efficient kernel reports a fully masked row's log-sum-exp as 0 (the CPU's
    arithmetic as about -3.4e38): a row before position ``SPAN`` must not weigh that part at all."""
    real, mixed = attention.context_part, []

    def like_the_gpu(q, key, value, bias, scale):
        out, lse = real(q, key, value, bias, scale)
        empty = (bias.view(bias.shape[0], out.shape[0], -1) != 0).all(-1).T[:, None]  # (blocks, 1, rows)
        mixed.append(bool(empty.any() and not empty.all()))
        return torch.where(empty[..., None], 0.0, out), torch.where(empty, 0.0, lse)

    canonical, masked = load(zoo["qwen2-untied"], torch.float32), load(zoo["qwen2-untied"], torch.float32, rows=None)
    ids = torch.tensor(IDS)
    canonical.reset(zero=True)
    masked.reset(zero=True)
    monkeypatch.setattr(attention, "context_part", like_the_gpu)
    a, b = canonical.feed(ids, 0), masked.feed(ids, 0)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-3), (a - b).abs().max()
    assert any(mixed)  # some blocks held a row's keys, others none


def path_frame(sl: ModelSlice, committed: int, device=CPU):
    """A frame below a context of ``committed`` positions (fed through ``feed``): a path of
    ``SPAN`` rows, its deepest ``SPAN - 1`` positions past the context, and a sibling; (the slice,
    the frame's inputs, the tokens, the scratch)."""
    sl.reset(zero=True)
    ids = [IDS[p % len(IDS)] for p in range(committed + SPAN)]
    sl.feed(torch.tensor(ids[:committed], device=device), 0, chunk=ROWS)
    sl.note(0, ids[:committed])
    scratch = Scratch(sl, 24)
    scratch.reset(committed)
    keys = [("path", p) for p in range(committed, committed + SPAN - 1)]
    rows = [(p, key, keys[:i]) for i, (p, key) in enumerate(zip(range(committed, committed + SPAN), keys))]
    rows.append((committed + 1, "sibling", keys[:1]))
    slots, mask = scratch.tree_inputs(rows, ROWS, device)
    return slots, mask, torch.tensor(ids[committed:committed + ROWS], device=device), scratch


def test_a_frame_over_the_window_its_scratch_reaches_reads_its_whole_context_part(zoo, monkeypatch):
    """A context one slot past a window (17 past 16): the deepest row's context part ends at slot
    16, which only the next window holds; ``Scratch.reach`` must pick that one."""
    monkeypatch.setattr(kv, "MIN_WINDOW", 8)
    canonical, masked = load(zoo["qwen2-untied"], torch.float32), load(zoo["qwen2-untied"], torch.float32, rows=None)
    outs, windows = [], []
    for sl in (canonical, masked):
        slots, mask, x, scratch = path_frame(sl, 17)
        outs.append(sl.run(x, slots, end=scratch.reach, tree=mask))
        windows.append(sl.window_for(scratch.reach))
    assert windows == [32, 64] and canonical.windows[:2] == [8, 16]  # the masked one reads its scratch through it
    assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-3), (outs[0] - outs[1]).abs().max()


def over_windows(path, dtype, device, monkeypatch, committed: int = 20) -> list[tuple[int, torch.Tensor]]:
    """A frame below a context of ``committed`` positions, computed over each window that holds the
    context (of 20: windows of 32, 64 and 80 slots of a cache of 80: context parts of 2, 4 and 5
    blocks of 16, the deepest row's keys in two of them; of 60: windows of 64 and 80, its keys in
    four): (the window, the frame's output)."""
    monkeypatch.setattr(kv, "SPAN", SPAN)
    monkeypatch.setattr(kv, "BLOCK", 16)
    monkeypatch.setattr(kv, "MIN_WINDOW", 8)
    sl = load(path, dtype, device=device, max_len=80)
    slots, mask, x, scratch = path_frame(sl, committed, device)
    windows = [w for w in sl.windows if w >= sl.window_for(scratch.reach)]
    return [(w, sl.forward(x, slots, window=w, tree=mask).clone()) for w in windows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_comes_out_the_same_over_every_window_that_holds_its_context(zoo, monkeypatch, dtype):
    outs = over_windows(zoo["qwen2-untied"], dtype, CPU, monkeypatch)
    assert [w for w, _ in outs] == [32, 64, 80]
    assert all(torch.equal(out, outs[0][1]) for _, out in outs[1:])


def test_blocks_are_summed_in_one_order_that_trailing_empty_blocks_do_not_change():
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(7, 3, 5, generator=gen) * torch.logspace(-6, 6, 7)[:, None, None]  # sums that round
    for used in range(1, 8):
        padded = [torch.cat([parts[:used], torch.full((extra, 3, 5), -0.0)]) for extra in range(0, 10)]
        sums = [attention.pairwise(p.clone()) for p in padded]
        assert all(torch.equal(s, sums[0]) for s in sums[1:])
    # a negative zero keeps its sign whatever empty blocks follow (an empty block is -0.0, not +0.0)
    assert all(torch.signbit(attention.pairwise(torch.full((c,), -0.0))) for c in range(1, 9))
    # the order is fixed: not the order a plain sum would take, which such magnitudes can tell apart
    assert not torch.equal(attention.pairwise(parts[:3].clone()), (parts[0] + parts[1]) + parts[2])
