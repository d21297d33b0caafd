"""A one-shape slice whose forwards are compiled whole (``ModelSlice(compiled=True)``, through
``GraphTable(compile=)``): checked on the CPU, where torch.compile traces the same functions a GPU
compiles (its speed: bench/head_compile.py)."""

from __future__ import annotations

import pytest
import torch

from sfchat.engine.scratch import Scratch
from sfchat.model.graphs import GraphTable
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource

CPU = torch.device("cpu")


def test_a_compiling_table_compiles_each_keys_function_once_and_runs_it():
    from torch._dynamo.utils import counters

    def fn(x, window):
        return x[:window] * 2 + 1

    table = GraphTable(compile={})
    x = torch.arange(8.0)
    before = counters["stats"]["unique_graphs"]
    assert torch.equal(table.run("k", fn, (x,), 4), x[:4] * 2 + 1)
    assert counters["stats"]["unique_graphs"] == before + 1  # compiled
    assert torch.equal(table.run("k", lambda *a: pytest.fail("a key's function is the first one given"), (x + 1,), 4),
                       (x + 1)[:4] * 2 + 1)
    assert counters["stats"]["unique_graphs"] == before + 1  # the same window: the same program
    assert torch.equal(table.run("k", fn, (x,), 6), x[:6] * 2 + 1)
    assert counters["stats"]["unique_graphs"] == before + 2  # another window: its own program
    assert table.code("k", fn) is table.code("k", None)
    plain = GraphTable()
    assert plain.code("k", fn) is fn


@pytest.mark.parametrize("lo, hi, embed, head", [(0, 2, True, False), (2, 4, False, True)])
def test_a_compiled_one_shape_slice_computes_what_the_plain_one_does(zoo, lo, hi, embed, head):
    """A tree frame and a prefill piece on both halves (the head's with the embedding, the tail's
    with the norm and lm_head): the compiled slice's outputs and K/V within float32 rounding of the
    plain slice's."""
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    rows, n_logits = 8, (8 if head else 0)
    slices = [ModelSlice.load(src, lo, hi, embed=embed, head=head, dtype=torch.float32, device=CPU, max_len=64,
                              rows=rows, compiled=c) for c in (False, True)]
    assert slices[1].compiled and slices[1].graphs.compile is not None and slices[0].graphs.compile is None
    gen = torch.Generator().manual_seed(0)
    context = (torch.randint(0, 300, (19,), generator=gen) if embed
               else torch.randn(19, src.config.hidden_size, generator=gen))
    frame = (torch.randint(0, 300, (rows,), generator=gen) if embed
             else torch.randn(rows, src.config.hidden_size, generator=gen))
    outs = []
    for sl in slices:
        sl.feed(context, 0)
        sl.note(0, list(range(19)))
        scratch = Scratch(sl, 17)
        scratch.reset(19)
        tree = [(19, "a", []), (20, "b", ["a"]), (20, "c", ["a"]), (21, "d", ["a", "b"])]
        slots, mask = scratch.tree_inputs(tree, rows, CPU)
        outs.append((sl.run(frame, slots, n_logits, end=scratch.reach, tree=mask), [t.clone() for t in sl.kv_tensors()]))
    (plain, plain_kv), (compiled, compiled_kv) = outs
    assert plain.shape == compiled.shape and torch.allclose(plain, compiled, rtol=1e-4, atol=1e-4)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(plain_kv, compiled_kv))
    assert slices[1].graphs._code  # the compiled functions ran


def test_a_slice_compiled_whole_needs_one_row_count(zoo):
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    with pytest.raises(ValueError, match="need one row count"):
        ModelSlice.load(src, 0, 2, embed=True, head=False, dtype=torch.float32, device=CPU, max_len=64, compiled=True)


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu"])
def test_a_heads_compile_frames_reaches_its_tail_and_the_reply_is_generates(zoo, device):
    """Local mode on the CPU with one row count: head and tail slices compiled whole (the hello
    names it: the tail follows), each segment its own program when the layers are spread over
    two devices, the greedy reply the target's own."""
    from sfchat.config import Settings
    from sfchat.events import ReplyFinished
    from sfchat.node.head import Head
    from sfchat.protocol.wire import Sampling

    from engine_runs import PROMPT, reference

    path = str(zoo["qwen2-untied"])
    session = Head.open(Settings(model=path, draft=path, k=2, device=device, frame_rows=16, compile_frames=True))
    tail = session.engine.link.verifier
    assert tail.hello.compiled_frames and tail.model.compiled and session.engine.spec.head.compiled
    assert len(tail.model.devices) == len(session.engine.spec.head.devices) == len(device.split(","))
    session.eos = set()
    ids = session.encode(PROMPT)
    fin = [e for e in session.reply(ids, 12, Sampling()) if isinstance(e, ReplyFinished)][-1]
    assert list(fin.token_ids) == reference(zoo["qwen2-untied"], ids, 12, eos=-1)
    for sl in (tail.model, session.engine.spec.head):  # compiled code ran on both, each segment its own
        assert {key[-1] for key in sl.graphs._code} == set(range(len(sl.devices)))


def test_compile_frames_without_one_row_count_is_refused_in_a_line(zoo):
    from sfchat import UserError
    from sfchat.config import Settings
    from sfchat.node.head import Head
    from sfchat.protocol import wire
    from sfchat.protocol.handshake import Hello

    path = str(zoo["qwen2-untied"])
    with pytest.raises(UserError, match="--compile-frames .* needs --frame-rows N"):
        Head.open(Settings(model=path, draft=path, k=2, device="cpu", compile_frames=True))
    with pytest.raises(wire.WireError, match="compiled_frames without one_shape"):
        Hello.parse(dict(Hello(model="m", revision=None, split=1, dtype="float32", max_len=64, n_layers=2,
                               hidden_size=8).__dict__, frames=[9], compiled_frames=True))


def test_a_table_whose_compile_fails_runs_the_plain_code_warned_until_one_compiled_run(monkeypatch):
    """A compile that fails before anything compiled ran: the table's plain functions from then on
    (every key), one warning; once a compiled function has run, a failure is raised."""
    def broken(fn, **kw):
        def run(*args):
            raise RuntimeError("no kernel for this GPU")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    table = GraphTable(compile={})
    x = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="compiling the forwards failed .*no kernel for this GPU.*uncompiled"):
        assert torch.equal(table.run("a", lambda x, w: x * w, (x,), 2), x * 2)
    assert table.compile is None and torch.equal(table.run("b", lambda x, w: x + w, (x,), 2), x + 2)

    calls = []

    def flaky(fn, **kw):
        def run(*args):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("out of memory")
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", flaky)
    table = GraphTable(compile={})
    assert torch.equal(table.run("a", lambda x, w: x * w, (x,), 2), x * 2)
    with pytest.raises(RuntimeError, match="out of memory"):
        table.run("a", lambda x, w: x * w, (x,), 2)
