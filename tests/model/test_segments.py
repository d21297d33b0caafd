"""Slices cut into segments: the code of a slice spread over two GPUs, run on the CPU by giving one
device several segments. Every output is compared bit for bit (torch.equal, fp32) with the same
slice in one segment: chain and tree forwards, windows, a committed path's K/V moved in every
segment. The whole engine with segmented halves: ``tests/node/test_segmented_parity.py``."""

from __future__ import annotations

import pytest
import torch

from sfchat.engine.scratch import Scratch
from tree_masks import tree_mask
from sfchat.model import kv as kv_module
from sfchat.model.decoder import layer_bytes, segment_runs, spread
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource

CPU = torch.device("cpu")
IDS = [3, 17, 42, 99, 5, 250, 7, 11, 13, 19, 23, 31, 37, 41]
PARENTS = [0, 0, 1, 1, 2, 4, 0]  # t0's children 1, 2, 7; 3, 4 under 1; 5 under 2; 6 under 4


def load(path, lo, hi, segments, *, embed, head, max_len=64):
    return ModelSlice.load(ModelSource.open(str(path)), lo, hi, embed=embed, head=head, dtype=torch.float32,
                           device=CPU, max_len=max_len, devices=[CPU] * segments)


def same_cache(a: ModelSlice, b: ModelSlice) -> bool:
    """Every layer's keys and values equal, whatever segment holds them."""
    def layers(sl):  # each layer's keys and values, in layer order, from the slice's segment-by-segment list
        tensors, out, i = sl.kv_tensors(), [], 0
        for lo, hi in sl.ranges:
            n = hi - lo
            out += list(zip(tensors[i:i + n], tensors[i + n:i + 2 * n]))
            i += 2 * n
        return out

    pairs_a, pairs_b = layers(a), layers(b)
    return len(pairs_a) == len(pairs_b) and all(torch.equal(x, y) for p, q in zip(pairs_a, pairs_b)
                                                for x, y in zip(p, q))


def test_layers_are_cut_into_runs_as_even_in_bytes_as_whole_layers_allow():
    assert spread(4, 1.0, [0, 0]) == [(0, 2), (2, 4)]
    assert spread(5, 1.0, [0, 0]) == [(0, 3), (3, 5)]  # ties to the earlier run
    assert spread(4, 1.0, [0, 0, 0]) == [(0, 2), (2, 3), (3, 4)]
    assert spread(1, 1.0, [0, 0]) == [(0, 1)] and spread(0, 1.0, [0, 0]) == [(0, 0)]  # no empty segment
    # an embedding of three layers' bytes on the first GPU: 3 + 4 against 6
    assert spread(10, 1.0, [3, 0]) == [(0, 4), (4, 10)]
    assert spread(10, 1.0, [0, 3]) == [(0, 7), (7, 10)]  # an lm_head on the last
    assert spread(10, 1.0, [3, 0, 3]) == [(0, 3), (3, 8), (8, 10)]
    # the heaviest run is as light as whole layers allow: no other cut does better
    for n, loads in [(10, [3, 0]), (9, [0, 2.5]), (13, [1.5, 0, 4])]:
        best = min(max(loads[j] + (b - a) for j, (a, b) in enumerate(cut))
                   for cut in contiguous_cuts(n, len(loads)))
        assert max(loads[j] + (b - a) for j, (a, b) in enumerate(spread(n, 1.0, loads))) == best


def contiguous_cuts(n, parts):
    if parts == 1:
        yield [(0, n)]
        return
    for first in range(1, n - parts + 2):
        for rest in contiguous_cuts(n - first, parts - 1):
            yield [(0, first)] + [(a + first, b + first) for a, b in rest]


def test_a_slice_is_balanced_around_its_embedding_lm_head_and_what_others_reserve(zoo):
    """The runs a slice is built with are ``segment_runs``: by bytes, the embedding in the first,
    the lm_head in the last, and what ``reserved`` says others (the draft) hold on a device."""
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    cfg = src.config
    layer = layer_bytes(cfg, torch.float32, "none")
    ends = cfg.vocab_size * cfg.hidden_size * 4
    assert 0.5 * layer < ends < layer  # the tiny model's embedding: two thirds of a layer
    head = ModelSlice.load(src, 0, 4, embed=True, head=False, dtype=torch.float32, device=CPU, max_len=16,
                           devices=[CPU, CPU])
    assert head.ranges == [(a, b) for a, b in spread(4, layer, [ends, 0])] == [(0, 2), (2, 4)]
    tail = ModelSlice.load(src, 0, 4, embed=False, head=True, dtype=torch.float32, device=CPU, max_len=16,
                           devices=[CPU, CPU], reserved=[3 * layer, 0])
    assert tail.ranges == [(a, b) for a, b in spread(4, layer, [3 * layer, ends])] == [(0, 1), (1, 4)]


@pytest.mark.parametrize("segments", [2, 3])
def test_segments_own_their_layers_and_caches(zoo, segments):
    sl = load(zoo["qwen2-untied"], 0, 4, segments, embed=True, head=True)
    runs = segment_runs(sl.config, 0, 4, embed=True, head=True, dtype=torch.float32, quant="none", segments=segments)
    assert len(runs) == segments and runs[0][0] == 0 and runs[-1][1] == 4
    assert sl.ranges == runs
    assert sl.devices == [CPU] * segments and len(sl.kv_tensors()) == 2 * 4  # a key and a value cache per layer
    for a, b in runs:  # each segment's layers fill its own cache from slot 0
        assert [layer.self_attn.layer_idx for layer in sl.layers[a:b]] == list(range(b - a))
    assert sl.capture(5, 5, log=lambda m: None) is False  # no CUDA: every segment runs its plain code


@pytest.mark.parametrize("family", ["qwen2-untied", "llama-tied", "qwen3-untied"])
@pytest.mark.parametrize("segments", [2, 3])
def test_chain_forwards_equal_the_unsegmented_slice(zoo, family, segments, monkeypatch):
    """Prefill, then verify-shaped forwards at later positions over narrower windows, through
    ``run`` and ``forward``: the head half, the tail half and the whole model (embedding and
    lm_head in different segments)."""
    monkeypatch.setattr(kv_module, "MIN_WINDOW", 8)
    path = zoo[family]
    ids = torch.tensor(IDS)
    for lo, hi, embed, head in [(0, 2, True, False), (0, 4, True, True), (1, 4, False, True)]:
        one = load(path, lo, hi, 1, embed=embed, head=head)
        cut = load(path, lo, hi, segments if hi - lo > 1 else 2, embed=embed, head=head)
        assert len(cut.devices) > 1 and cut.windows == [8, 16, 32, 64]
        x = ids if embed else torch.randn(len(IDS), 64, generator=torch.Generator().manual_seed(lo))
        rows = 6 if head else 0
        a = one.run(x[:6], torch.arange(6), rows, end=6)
        b = cut.run(x[:6], torch.arange(6), rows, end=6)
        assert torch.equal(a, b)
        for start, stop in [(6, 9), (9, 14)]:  # windows 16 (9 ends in 16) then 16
            n = stop - start
            a = one.run(x[start:stop], torch.arange(start, stop), n if head else 0, end=stop)
            b = cut.run(x[start:stop], torch.arange(start, stop), n if head else 0, end=stop)
            assert torch.equal(a, b), (lo, hi, start)
        assert torch.equal(one.forward(x[:3], torch.arange(11, 14), 2 if head else 0),
                           cut.forward(x[:3], torch.arange(11, 14), 2 if head else 0))
        assert same_cache(one, cut)


@pytest.mark.parametrize("segments", [2, 3])
def test_tree_forwards_and_a_committed_path_equal_the_unsegmented_slice(zoo, segments):
    """A tree frame after a context (the mask and rotary positions from the tree), the committed
    path's K/V moved into place by the slice's scratch (``Scratch.commit``) in every segment's
    cache, a sibling that stays live moved out of the context's way, the next forward on top."""
    path = zoo["llama-untied"]
    one = load(path, 0, 4, 1, embed=True, head=True)
    cut = load(path, 0, 4, segments, embed=True, head=True)
    ids = torch.tensor(IDS)
    n = 6
    for sl in (one, cut):
        sl.run(ids[:n], torch.arange(n), 1, end=n)
        sl.note(0, IDS[:n])
    frame = torch.tensor([IDS[n]] + [41, 7, 99, 250, 3, 5, 17])  # t0 and seven nodes
    slots = torch.arange(n, n + len(frame))
    t = tree_mask(PARENTS, n, CPU)
    a = one.run(frame, slots, len(frame), end=n + len(frame), tree=t)
    b = cut.run(frame, slots, len(frame), end=n + len(frame), tree=t)
    assert torch.equal(a, b)
    assert same_cache(one, cut)
    path_nodes = [0, 1, 4, 6]  # t0, node 1, its child 4, 4's child 6
    for sl in (one, cut):
        scratch = Scratch(sl, len(frame) + 1)
        scratch.reset(n)
        assert [scratch.take(i) for i in range(len(frame))] == slots.tolist()
        for i in (3, 5):  # dead nodes give their slots back; 2 (a sibling of 1) stays live
            scratch.release(i)
        scratch.commit(path_nodes, frame[path_nodes].tolist())
        assert scratch.slot(2) >= n + len(path_nodes)  # it was in the way: moved out of the context
    assert same_cache(one, cut) and one.cached_tokens() == cut.cached_tokens() == IDS[:n] + frame[path_nodes].tolist()
    m = n + len(path_nodes)
    after = [sl.run(torch.tensor([13, 29]), torch.arange(m, m + 2), 2, end=m + 2) for sl in (one, cut)]
    assert torch.equal(*after)
    fresh = load(path, 0, 4, 1, embed=True, head=True)  # the committed path equals a plain chain forward
    context = IDS[:n] + frame[path_nodes].tolist() + [13, 29]
    chain = fresh.forward(torch.tensor(context), torch.arange(len(context)), 2)
    torch.testing.assert_close(after[0], chain, rtol=1e-5, atol=1e-5)
