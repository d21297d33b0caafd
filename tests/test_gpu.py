"""CUDA-only checks (skipped without a GPU): graphed forwards are bit-identical to eager ones (one
segment or several, on one GPU or two), graphs of one device sharing its memory pool do not
disturb each other's results, the graphed engine keeps greedy parity with transformers'
generate(), and a canonical row is the same bits over every window, compiled or not."""

from __future__ import annotations

import pytest
import torch

from sfchat.config import AUTO_FRAME_ROWS, Settings
from sfchat.events import ReplyFinished
from sfchat.node.head import Head
from sfchat.model import attention
from sfchat.model.graphs import GraphTable
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_slices_are_bit_identical_to_eager(zoo, dtype):
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    dev = torch.device("cuda")
    head = ModelSlice.load(src, 0, 2, embed=True, head=False, dtype=dtype, device=dev, max_len=64)
    tail = ModelSlice.load(src, 2, 4, embed=False, head=True, dtype=dtype, device=dev, max_len=64)
    k = 8
    assert head.capture(k + 1) and tail.capture(k + 1, k + 1)
    prefix = torch.randint(0, 300, (20,), device=dev)
    head.forward(prefix, torch.arange(20, device=dev))
    tail.forward(head.forward(prefix, torch.arange(20, device=dev)), torch.arange(20, device=dev), 1)
    ids = torch.randint(0, 300, (k + 1,), device=dev)
    pos = torch.arange(20, 20 + k + 1, device=dev)
    h_eager = head.forward(ids, pos).clone()
    h_graph = head.run(ids, pos).clone()
    assert torch.equal(h_eager, h_graph)
    l_eager = tail.forward(h_eager, pos, k + 1).clone()
    l_graph = tail.run(h_eager, pos, k + 1).clone()
    assert torch.equal(l_eager, l_graph)


def expansion_rows(drafter, context: int, n: int):
    """``n`` nodes of a small tree right after a context of ``context`` tokens: a chain of three and
    siblings of its first node, each keyed by its index, with its ancestors' keys."""
    rows = []
    for i in range(n):
        parent = rows[i - 1] if 0 < i < 3 else (rows[0] if i >= 3 else None)
        depth = 1 if parent is None else parent[4] + 1
        ancestors = [] if parent is None else parent[3] + [parent[2]]
        rows.append((7 + 3 * i, context - 1 + depth, i, ancestors, depth))
    return [r[:4] for r in rows]


@pytest.mark.parametrize("blocks_from", [0, 256], ids=["sdpa", "blocks"])
@pytest.mark.parametrize("s", [Sampling(), Sampling(0.7, 0, 1.0, 3), Sampling(1.3, 20, 0.9, 4)], ids=str)
def test_the_drafts_expansion_step_replays_from_graphs_as_it_runs_eagerly(zoo, s, blocks_from, monkeypatch):
    """One graph per window for the expansion step, greedy and sampled (the settings are its inputs):
    a replay gives exactly the proposals the plain code gives from the same cache; the attention
    masked (SDPA) or in blocks (the one 256-slot window in two of 128)."""
    from sfchat.engine.draft import Drafter

    blocked, calls = attention.in_blocks, []
    monkeypatch.setattr(attention, "in_blocks", lambda *a: calls.append(1) or blocked(*a))
    model = ModelSlice.load(ModelSource.open(str(zoo["llama-untied"])), 0, 4, embed=True, head=True,
                            dtype=torch.bfloat16, device=torch.device("cuda"), max_len=256)
    drafter = Drafter(model, width=8, children=8, pool=40, blocks_from=blocks_from)
    assert drafter.capture() and ("expand", s.temperature > 0) in drafter.graphs
    graphs = drafter.graphs
    context = list(range(5, 60))
    results = []
    for table in (GraphTable(), graphs):  # eagerly, then replayed, from the same cache
        drafter.graphs = GraphTable()
        drafter.reset()
        drafter.sync(context)
        drafter.graphs = table
        results.append(drafter.expand(expansion_rows(drafter, len(context) + 1, 6), s))
    assert results[0] == results[1]
    assert bool(calls) == bool(blocks_from)


@pytest.mark.parametrize("k", [1, 8])
def test_graphed_engine_keeps_greedy_parity(zoo, k):
    from transformers import AutoModelForCausalLM

    path = zoo["qwen2-tied"]
    session = Head.open(Settings(model=str(path), draft=str(zoo["draft"]), k=k, device="cuda",
                                        dtype="float32"))
    assert session.engine.head.graphs and session.engine.drafter.graphs
    ids = session.encode([{"role": "user", "content": "hello world"}])
    fin = [e for e in session.reply(ids, 24, Sampling()) if isinstance(e, ReplyFinished)][0]
    model = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    ref = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()


def test_each_attention_window_has_its_graph_and_matches_eager(zoo, monkeypatch):
    from sfchat.model import kv
    from sfchat.engine.draft import Drafter

    monkeypatch.setattr(kv, "MIN_WINDOW", 16)
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    dev = torch.device("cuda")
    tail = ModelSlice.load(src, 2, 4, embed=False, head=True, dtype=torch.bfloat16, device=dev, max_len=64)
    k = 4
    assert tail.capture(k + 1, k + 1) and tail.graphs.windows((k + 1, k + 1, False, 0)) == [16, 32, 64]
    hidden = torch.randn(60, 64, device=dev).to(torch.bfloat16)
    tail.forward(hidden[:55], torch.arange(55, device=dev), 1)
    for first in (3, 20, 40, 55):  # windows 16, 32, 64, 64
        pos = torch.arange(first, first + k + 1, device=dev)
        x = hidden[first:first + k + 1]
        window = tail.window_for(first + k + 1)
        eager = tail.forward(x, pos, k + 1, window).clone()
        assert torch.equal(tail.run(x, pos, k + 1, end=first + k + 1), eager)
    drafter = Drafter(ModelSlice.load(ModelSource.open(str(zoo["draft"])), 0, 2, embed=True, head=True,
                                      dtype=torch.bfloat16, device=dev, max_len=64), width=4, children=4, pool=12)
    assert drafter.capture() and drafter.graphs.windows(("expand", False)) == [16, 32, 64]
    graphs = drafter.graphs
    for context in (3, 20, 40):  # windows 16, 32, 64
        results = []
        for table in (GraphTable(), graphs):
            drafter.graphs = GraphTable()
            drafter.reset()
            drafter.sync(list(range(5, 5 + context)))
            drafter.graphs = table
            results.append(drafter.expand(expansion_rows(drafter, context + 1, 5), Sampling()))
        assert results[0] == results[1]


@pytest.mark.parametrize("budget, compiled", [(8, False), (32, False), (32, True)])
def test_graphed_tree_engine_keeps_greedy_parity(zoo, monkeypatch, budget, compiled):
    """Trees on a GPU: the draft's tree, the head's and the tail's tree forwards all replayed from
    graphs (the mask a graph input), canonical attention compiled or not, and the output still
    generate()'s."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(attention, "COMPILE", attention.COMPILE)  # the head sets it from its settings
    path = zoo["qwen2-tied"]
    session = Head.open(Settings(model=str(path), draft=str(zoo["draft"]), k=5, tree_budget=budget,
                                 device="cuda", dtype="float32", compile_draft=False, compile_attention=compiled))
    engine = session.engine
    rows = AUTO_FRAME_ROWS  # every forward of the target at one row count on a GPU
    assert engine.head.captured(rows, tree=True) and ("expand", False) in engine.drafter.graphs
    assert engine.link.verifier.model.captured(rows, rows, tree=True)
    ids = session.encode([{"role": "user", "content": "hello world"}])
    fin = [e for e in session.reply(ids, 32, Sampling()) if isinstance(e, ReplyFinished)][0]
    model = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    ref = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()
    if compiled:  # it did compile (a failed compile falls back, warned, to the plain function)
        assert attention._proven and attention._compiled is not attention.canonical


def test_the_compiled_draft_compiles_once_whatever_the_prompts(zoo):
    """A GPU compiles the draft for its expansion step by default: replies to prompts of three
    lengths compile nothing more (the draft's prefill runs the plain forward: it used to compile
    anew for each new length) and stay generate()'s."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    path = zoo["qwen2-tied"]
    session = Head.open(Settings(model=str(path), draft=str(zoo["draft"]), k=5, device="cuda", dtype="float32"))
    drafter = session.engine.drafter
    assert drafter.forward is not drafter.model.forward  # compiled (the default)
    before = counters["stats"]["unique_graphs"]
    model = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    for text in ("hi", "hello world, how are you today?", "one two three " * 12):
        ids = session.encode([{"role": "user", "content": text}])
        fin = [e for e in session.reply(ids, 16, Sampling()) if isinstance(e, ReplyFinished)][0]
        ref = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert list(fin.token_ids) == ref[0, len(ids):].tolist()
    assert counters["stats"]["unique_graphs"] == before


def test_graphed_tree_forward_is_bit_identical_to_eager(zoo):
    from tree_masks import tree_mask

    src = ModelSource.open(str(zoo["qwen2-untied"]))
    dev = torch.device("cuda")
    tail = ModelSlice.load(src, 2, 4, embed=False, head=True, dtype=torch.bfloat16, device=dev, max_len=64)
    assert tail.capture(9, 9, tree=True)
    hidden = torch.randn(9, 64, device=dev, dtype=torch.bfloat16)
    mask = tree_mask([0, 0, 1, 1, 2, 5, 6, 6], 20, dev)
    pos = torch.arange(20, 29, device=dev)
    assert torch.equal(tail.forward(hidden, pos, 9, tail.max_len, mask).clone(),
                       tail.run(hidden, pos, 9, tree=mask).clone())


def segment_cases():
    cases = [[torch.device("cuda")] * 2, [torch.device("cuda")] * 3]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        cases.append([torch.device("cuda:0"), torch.device("cuda:1")])
    return cases


@pytest.mark.parametrize("devices", segment_cases(), ids=lambda d: ",".join(map(str, d)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_segment_graphs_replay_bit_identically_to_eager(zoo, devices, dtype):
    """A slice cut into segments (on one GPU, or on two when there are two) captures one graph per
    segment, window and shape; replayed, chain and tree forwards equal the segmented slice's eager
    forward and the unsegmented slice's graphed one, bit for bit."""
    from tree_masks import tree_mask

    src = ModelSource.open(str(zoo["qwen2-untied"]))
    dev = devices[0]
    for lo, hi, embed, head in [(0, 4, True, False), (0, 4, False, True)]:
        one = ModelSlice.load(src, lo, hi, embed=embed, head=head, dtype=dtype, device=dev, max_len=64)
        cut = ModelSlice.load(src, lo, hi, embed=embed, head=head, dtype=dtype, device=dev, max_len=64,
                              devices=devices)
        assert cut.devices == devices
        rows = 9 if head else 0
        for sl in (one, cut):
            assert sl.capture(9, rows) and sl.capture(9, rows, tree=True) and sl.captured(9, rows)
        assert len(cut.graphs) == len(devices) * len(one.graphs)
        gen = torch.Generator(device=dev).manual_seed(lo)
        x = (torch.randint(0, 300, (29,), device=dev, generator=gen) if embed
             else torch.randn(29, 64, device=dev, generator=gen).to(dtype))
        for sl in (one, cut):
            sl.forward(x[:20], torch.arange(20, device=dev), rows)
        pos = torch.arange(20, 29, device=dev)
        mask = tree_mask([0, 0, 1, 1, 2, 5, 6, 6], 20, dev)
        for tree in (None, mask):
            eager = cut.forward(x[20:], pos, rows, cut.window_for(29), tree).clone()
            graphed = cut.run(x[20:], pos, rows, end=29, tree=tree).clone()
            assert torch.equal(eager, graphed)
            assert torch.equal(graphed, one.run(x[20:], pos, rows, end=29, tree=tree))


def test_graphs_sharing_a_pool_leave_each_others_results_alone(zoo):
    """Every graph of a device is captured into one memory pool, so one graph's temporaries may lie
    where another's outputs are: a replay hands back copies, which later replays of other graphs
    (another slice, another window, another shape) leave as they were."""
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    dev = torch.device("cuda")
    head = ModelSlice.load(src, 0, 2, embed=True, head=False, dtype=torch.float32, device=dev, max_len=64)
    tail = ModelSlice.load(src, 2, 4, embed=False, head=True, dtype=torch.float32, device=dev, max_len=64)
    for n in (3, 9):
        assert head.capture(n) and tail.capture(n, n)
    ids = torch.randint(0, 300, (9,), device=dev)
    pos = torch.arange(9, device=dev)
    h = head.run(ids, pos, end=9)
    kept_h = h.clone()
    logits = tail.run(h, pos, 9, end=9)
    kept_logits = logits.clone()
    for _ in range(3):  # the other shapes' graphs of both slices, replayed meanwhile
        tail.run(torch.randn(3, 64, device=dev), pos[:3], 3, end=3)
        head.run(ids[:3], pos[:3], end=3)
    torch.cuda.synchronize()
    assert torch.equal(h, kept_h) and torch.equal(logits, kept_logits)


def test_graphed_engine_with_segmented_halves_keeps_greedy_parity(zoo, monkeypatch, tmp_path):
    """``--device`` naming the GPU twice: head and tail halves as two segments each, every segment
    graphed, a draft whose committed paths skip likelier siblings (every segment's K/V must move),
    and the reply is generate()'s (fp32)."""
    from transformers import AutoModelForCausalLM

    import sfchat.node.loading as loading
    from machines import noisy_copy

    real = loading.resolve_devices
    monkeypatch.setattr(loading, "resolve_devices",
                        lambda name: [torch.device("cuda")] * 2 if name == "twice" else real(name))
    path = zoo["qwen2-tied"]
    draft = noisy_copy(path, tmp_path / "noisy", 0.3)  # committed paths that skip likelier siblings
    session = Head.open(Settings(model=str(path), draft=str(draft), k=4, tree_budget="auto", device="twice",
                                 dtype="float32", compile_draft=False))
    head, tail = session.engine.head, session.engine.link.verifier.model
    assert len(head.devices) == len(tail.devices) == 2
    rows = AUTO_FRAME_ROWS  # the GPU default's frame (its drafts and the root) and every other forward's
    assert head.captured(rows, tree=True) and tail.captured(rows, rows, True)
    jumps = []
    move = head.move
    head.move = lambda src, dst: (jumps.append(any(s != d for s, d in zip(src, dst))), move(src, dst))[1]
    ids = session.encode([{"role": "user", "content": "hello world"}])
    fin = [e for e in session.reply(ids, 32, Sampling()) if isinstance(e, ReplyFinished)][0]
    assert any(jumps)
    model = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    ref = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_canonical_row_comes_out_the_same_over_every_window_on_the_gpu(zoo, monkeypatch, dtype, compiled):
    from test_attention import over_windows  # the CPU test's frame, on the GPU's kernels

    monkeypatch.setattr(attention, "COMPILE", compiled)
    outs = over_windows(zoo["qwen2-untied"], dtype, torch.device("cuda"), monkeypatch)
    assert [w for w, _ in outs] == [32, 64, 80]
    assert all(torch.equal(out, outs[0][1]) for _, out in outs[1:])
    outs = over_windows(zoo["qwen2-untied"], dtype, torch.device("cuda"), monkeypatch, committed=60)
    assert [w for w, _ in outs] == [64, 80]  # a context part in four blocks, then in five
    assert torch.equal(outs[0][1], outs[1][1])
    assert not compiled or (attention._proven and attention._compiled is not attention.canonical)


@pytest.mark.parametrize("head", [False, True], ids=["head slice", "tail slice"])
def test_a_one_shape_prefill_replays_the_verify_graph_bit_identically(zoo, monkeypatch, head):
    """A one-shape slice's prefill pieces are tree forwards of a chain: the captured verify graph
    replays every piece (eagerly they cost ~8x as much on an H100), and the K/V and hidden rows are
    the bits the plain padded forwards give."""
    from sfchat.model import graphs as graphs_mod

    src = ModelSource.open(str(zoo["qwen2-untied"]))
    dev, rows = torch.device("cuda"), 16
    sl = ModelSlice.load(src, 0 if head else 2, 2 if head else 4, embed=head, head=not head, dtype=torch.bfloat16,
                         device=dev, max_len=96, rows=rows)
    assert sl.capture(rows, 0 if head else rows, tree=True, span=rows + 1)
    replays = []
    call = graphs_mod.Graphed.__call__
    monkeypatch.setattr(graphs_mod.Graphed, "__call__", lambda self, *xs: replays.append(1) or call(self, *xs))
    gen = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 300, (40,), generator=gen) if head
         else torch.randn(40, src.config.hidden_size, generator=gen).to(torch.bfloat16)).to(dev)
    sl.reset(zero=True)
    fed = sl.feed(x, 0)
    assert len(replays) == 3  # 40 positions in three pieces of 16, every one replayed
    fed_kv = [t.clone() for t in sl.kv_tensors()]
    sl.reset(zero=True)
    pieces = []
    for i in range(0, 40, rows):
        n = min(rows, 40 - i)
        piece = torch.cat([x[i:i + n], x.new_zeros((rows - n,) + x.shape[1:])])
        positions = torch.cat([torch.arange(i, i + n), torch.full((rows - n,), sl.max_len)]).to(dev)
        pieces.append(sl.forward(piece, positions, 0 if head else 1, window=sl.window_for(i + n))[:n])
    assert all(torch.equal(a, b) for a, b in zip(fed_kv, sl.kv_tensors()))
    if head:
        assert torch.equal(fed, torch.cat(pieces))


def test_a_gpu_head_and_its_local_tail_settle_their_heap_once_loaded(zoo, monkeypatch):
    """The head once its models are loaded and captured, the local tail once it captured the
    hello's shapes: their long-lived objects leave the collector's scans (``node.heap``)."""
    from sfchat.node import heap

    calls = []
    monkeypatch.setattr(heap, "settle", lambda: calls.append(1))
    Head.open(Settings(model=str(zoo["qwen2-tied"]), draft=str(zoo["draft"]), k=2, device="cuda", dtype="float32"))
    assert calls == [1, 1]


def test_frames_compiled_whole_keep_greedy_parity_and_replay_from_graphs(zoo):
    """``--compile-frames`` on a GPU: the head's and the tail's one-shape forwards compiled whole
    and captured, the output still generate()'s."""
    from transformers import AutoModelForCausalLM

    path = zoo["qwen2-tied"]
    session = Head.open(Settings(model=str(path), draft=str(zoo["draft"]), k=5, tree_budget=32, device="cuda",
                                 dtype="float32", compile_draft=False, compile_frames=True))
    engine = session.engine
    rows = AUTO_FRAME_ROWS
    head, tail = engine.head, engine.link.verifier.model
    assert head.compiled and tail.compiled
    assert head.captured(rows, tree=True) and tail.captured(rows, rows, tree=True)
    ids = session.encode([{"role": "user", "content": "hello world"}])
    fin = [e for e in session.reply(ids, 32, Sampling()) if isinstance(e, ReplyFinished)][0]
    model = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    ref = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()
