"""The CUDA graphs in the memory estimate: one pool per device, every graph the code captures
counted (recorded on the CPU), and the graphs a HELLO adds to a tail that is already loaded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sfchat import UserError
from sfchat.model import footprint
from sfchat.model.footprint import GIB, Graph, Need, device_bytes, draft_graphs, slice_needs
from sfchat.model.memory import check_graphs, graphs_to_capture
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.handshake import Hello

from memory_configs import gpus, qwen7b  # noqa: F401  (a fixture and a config)


def test_one_device_holds_one_workspace_and_one_graph_pool():
    """Forwards on a device run one at a time and its graphs share one pool: the largest workspace
    and the largest graph's temporaries count once, every graph's outputs each."""
    a = Need(weights=GIB, kv=GIB, work=GIB // 2, graphs=(Graph(400 << 20, 10 << 20),) * 3)
    b = Need(weights=GIB, kv=0, work=GIB // 4, graphs=(Graph(100 << 20, 1 << 20),))
    both = device_bytes([a, b])
    base = a.weights * 21 // 20 + b.weights * 21 // 20 + a.kv + GIB // 2 + footprint.FIXED_SLACK
    assert both == base + footprint.POOL_BASE + (400 << 20) + 3 * (10 << 20) + (1 << 20) + 4 * footprint.GRAPH_BYTES
    assert both < a.total + b.total


def test_the_estimate_counts_every_graph_the_code_captures(zoo, monkeypatch):
    """Every graph the head (``capture_graphs``), the draft (``Drafter.capture``, compiled or not)
    and the tail (the verifier's capture of a HELLO's shapes) would capture, recorded on the CPU,
    is one graph of the estimate: same shapes, same windows, per segment."""
    from sfchat.config import Settings
    from sfchat.engine.draft import Drafter
    from sfchat.model import kv as kv_module
    from sfchat.model.graphs import GraphTable
    from sfchat.node.loading import capture_graphs, frame_layout

    monkeypatch.setattr(kv_module, "MIN_WINDOW", 16)
    taken = []

    def record(table, key, what, fn, inputs, windows, log=None):
        taken.append((key, tuple(windows)))
        return True

    monkeypatch.setattr(GraphTable, "capture", record)
    target, draft = ModelSource.open(str(zoo["qwen2-untied"])), ModelSource.open(str(zoo["draft"]))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    k, max_len = 4, 100
    layout = frame_layout(Settings(k=k, tree_budget=12, max_in_flight=2, frame_rows=0), k, cuda=True)
    hello = Hello(model="m", revision=None, split=2, dtype="float32", max_len=max_len, n_layers=4, hidden_size=64,
                  frames=(layout.size,))
    for segments in (1, 2):
        taken.clear()
        head = ModelSlice.load(target, 0, 2, embed=True, head=False, dtype=torch.float32, device=cpu,
                               max_len=max_len, devices=[cpu] * segments)
        capture_graphs(head, None, layout, False, lambda *a: None)
        tail = ModelSlice.load(target, 2, 4, embed=False, head=True, dtype=torch.float32, device=cpu,
                               max_len=max_len, devices=[cpu] * segments)
        for m, is_tree in hello.shapes():
            tail.capture(m, m, tree=is_tree)
        counted = [len(n.graphs) for lo, hi, head_, span in [(0, 2, False, layout.head_pool), (2, 4, True, 0)]
                   for _, n in slice_needs(target.config, lo, hi, embed=not head_, head=head_, dtype=torch.float32,
                                           quant="none", max_len=max_len, devices=[cuda] * segments,
                                           verifies=hello.shapes(), span=span)]
        # the 13-node frame: on the head over its 40-slot pool (windows 64 and 100), on the tail
        # over windows 16, 32, 64 and 100
        assert layout.head_pool == 40
        assert sum(len(w) for _, w in taken) == sum(counted) == segments * (2 + 4)
    # one row count for every forward (a GPU's default): the frame padded to 64 rows, over every window
    layout = frame_layout(Settings(k=k, tree_budget=12, max_in_flight=2), k, cuda=True)
    hello = Hello(model="m", revision=None, split=2, dtype="float32", max_len=max_len, n_layers=4, hidden_size=64,
                  frames=(layout.shape,), one_shape=True)
    taken.clear()
    head = ModelSlice.load(target, 0, 2, embed=True, head=False, dtype=torch.float32, device=cpu, max_len=max_len,
                           rows=layout.rows)
    capture_graphs(head, None, layout, False, lambda *a: None)
    tail = ModelSlice.load(target, 2, 4, embed=False, head=True, dtype=torch.float32, device=cpu, max_len=max_len,
                           rows=hello.rows)
    for m, is_tree in hello.shapes():
        tail.capture(m, m, tree=is_tree)
    counted = [len(n.graphs) for lo, hi, head_, span in [(0, 2, False, layout.head_pool), (2, 4, True, 0)]
               for _, n in slice_needs(target.config, lo, hi, embed=not head_, head=head_, dtype=torch.float32,
                                       quant="none", max_len=max_len, devices=[cuda], verifies=hello.shapes(),
                                       span=span, one_shape=True)]
    assert (layout.rows, layout.head_pool) == (64, 65)
    every = (16, 32, 64, max_len)  # canonical attention: any window, whatever the shape and the head's pool
    assert taken == [((64, 0, True, 0), every), ((64, 64, True, 0), every)] and sum(counted) == 2 * len(every)
    dmodel = ModelSlice.load(draft, 0, 2, embed=True, head=True, dtype=torch.float32, device=cpu, max_len=max_len)
    windows = {}
    for compiled in (False, True):
        taken.clear()
        Drafter(dmodel, width=layout.width, children=layout.children, pool=30).capture(compile=compiled)
        counted = draft_graphs(draft.config, torch.float32, "none", max_len, rows=layout.width + 1,
                               children=layout.children, pool=30)
        assert sum(len(w) for _, w in taken) == len(counted) > 0
        windows[compiled] = [w for _, w in taken]
    # compiled or not, the draft's step has a graph per window that holds its 30-slot pool (greedy and
    # sampled): a compiled one over all slots read every slot at every step
    assert windows[True] == windows[False] == [(32, 64, max_len)] * 2


def test_graphs_a_hello_adds_to_a_loaded_tail_are_counted_and_checked(gpus):
    """A tail holding graphs for one HELLO's shapes: the same shapes again add nothing; a HELLO with
    new shapes adds theirs, and is refused when they do not fit in what is free now."""
    have = {(9, False)}
    tail = SimpleNamespace(config=qwen7b(), lo=14, hi=28, embed_tokens=None, lm_head=object(), dtype=torch.float16,
                           quant="none", max_len=4096 + 257, devices=[torch.device("cuda:0")], ranges=[(14, 28)], rows=None,
                           captured=lambda m, logits, tree: (m, tree) in have)
    assert graphs_to_capture(tail, [(9, False)]) == []
    check_graphs(tail, [(9, False)])  # nothing to add: no check at all
    [(what, device, need)] = graphs_to_capture(tail, [(9, False), (257, True)])
    assert what == "CUDA graphs of layers [14, 28)" and device == torch.device("cuda:0")
    assert len(need.graphs) == 5 and all(g.outputs == 257 * 152064 * 4 for g in need.graphs)
    gpus[0] = need.total + (1 << 20)
    check_graphs(tail, [(9, False), (257, True)])
    gpus[0] = need.total - (1 << 20)
    with pytest.raises(UserError) as err:
        check_graphs(tail, [(9, False), (257, True)])
    assert "CUDA graphs of layers [14, 28)" in str(err.value) and "a smaller --tree-budget on the head (now 256" in str(
        err.value)
