"""The tail's reaction to bad frames: one ERROR frame and a TailError, and a Verifier that stays
usable for the next (correct) head."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sfchat.engine.speculator import hidden_bytes
from sfchat.engine.verifier import Verifier
from sfchat.node.tail_loader import TailLoader
from sfchat.protocol.wire import PROTOCOL_VERSION, Control, DType, Forward, MsgType, Verdict, decode, encode

from wire_frames import frame
from tail_cases import (  # noqa: F401  (fixture)
    K, PROMPT, check_serves, greedy_reference, hello_for, replies, tail_case, tree_frames
)


def test_tail_refuses_malformed_frames_and_stays_usable(tail_case):
    good, other, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    assert "malformed frame" in replies(v, b"garbage", fails=True)
    assert "bad magic" in replies(v, b"X" * 40, fails=True)
    msg = replies(v, frame(MsgType.HELLO, b"{}", version=PROTOCOL_VERSION + 1), fails=True)
    assert "malformed frame" in msg and "version" in msg
    assert replies(v, fwd[1], fails=True) == "FORWARD before HELLO"
    assert "unexpected" in replies(v, encode(Verdict(1, 1, (0,), (1,))), fails=True)
    assert "unexpected" in replies(v, encode(Control(MsgType.READY, {})), fails=True)
    assert replies(v, encode(Control(MsgType.BYE)), fails=False) == []
    check_serves(v, good, ref, fwd)


@pytest.mark.parametrize("changes, message", [
    ({"n_layers": 5}, "not the same model"),
    ({"hidden_size": 32}, "not the same model"),
    ({"n_layers": "many"}, "incomplete hello"),
    ({"split": None}, "incomplete hello"),
    ({"model": None}, "incomplete hello"),
    ({"model": 5}, "incomplete hello"),
    ({"split": "two"}, "incomplete hello"),
    ({"max_len": -1}, "incomplete hello"),
    ({"dtype": ["float32"]}, "incomplete hello"),
    ({"split": 9}, "out of range"),
    ({"dtype": "float64"}, "unknown dtype"),
    ({"frames": [257]}, "within 1..256"),
    ({"frames": [True]}, "is not a list of 1 to"),
    ({"frames": [8, 4]}, "must ascend"),
    ({"frames": list(range(1, 9))}, "is not a list of 1 to 6 integers"),
    ({"one_shape": True}, "one_shape with the frame shapes [4, 8]: it takes exactly one"),
    ({"one_shape": 1}, "incomplete hello"),
    ({"compiled_attention": 1}, "incomplete hello"),
    ({"compiled_attention": "true"}, "incomplete hello"),
])
def test_tail_refuses_a_bad_hello_and_stays_usable(tail_case, changes, message):
    good, other, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    assert message in replies(v, hello_for(good, **changes), fails=True)
    assert v.rounds == 0
    check_serves(v, good, ref, fwd)


def test_tail_never_reuses_the_model_of_a_refused_hello(tail_case):
    """Serving A, a refused hello for B loads B; A's next hello must not get B's weights as 'reused'."""
    good, other, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    check_serves(v, good, ref, fwd)
    assert "not the same model" in replies(v, hello_for(other, n_layers=3), fails=True)
    check_serves(v, good, ref, fwd)


def test_tail_refuses_a_context_hole_and_mismatched_hidden_states(tail_case):
    good, other, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good), fails=False)
    pre, tree = decode(fwd[0]), decode(fwd[1])
    assert "context hole: the tail holds 0 positions, the head wrote at 5" in replies(
        v, encode(replace(pre, start_pos=5)), fails=True)
    assert "context hole: the tail holds 0 positions" in replies(v, fwd[1], fails=True)  # a root past the context
    narrow = encode(replace(pre, hidden=pre.hidden[: len(pre.tokens) * 32 * 4], hidden_size=32))
    assert "do not match" in replies(v, narrow, fails=True)
    half = encode(replace(pre, hidden=pre.hidden[: len(pre.tokens) * 64 * 2], dtype=DType.FLOAT16))
    assert "do not match" in replies(v, half, fails=True)
    late = encode(replace(pre, start_pos=60))
    assert "exceed the context of 64" in replies(v, late, fails=True)
    assert replies(v, fwd[0], fails=False) == []
    (verdict,) = replies(v, fwd[1], fails=False)  # the refusals left no trace in the cache
    assert list(verdict.tokens) == ref
    assert "a prefill FORWARD inside tree 1" in replies(v, fwd[0], fails=True)
    assert "opened twice" in replies(v, encode(replace(tree, round=2)), fails=True)


def test_runnable_dtype_swaps_bf16_for_fp16_only_on_a_gpu_without_bf16(monkeypatch):
    from sfchat.model.devices import runnable_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)  # a T4
    assert runnable_dtype(cuda, torch.bfloat16) is torch.float16
    assert runnable_dtype(cuda, torch.float32) is torch.float32
    assert runnable_dtype(cpu, torch.bfloat16) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100
    assert runnable_dtype(cuda, torch.bfloat16) is torch.bfloat16


def test_a_tail_computing_in_another_dtype_converts_the_heads_hidden_states(tail_case, monkeypatch):
    """A bf16 head and a tail whose GPU lacks bf16: the tail loads in its own dtype (here float32,
    standing in for a T4's float16), says so, and converts every FORWARD's bf16 hidden states."""
    import sfchat.node.tail_loader as tail_module

    good, _, ref, fwd = tail_case
    monkeypatch.setattr(tail_module, "runnable_dtype",
                        lambda device, dtype: torch.float32 if dtype is torch.bfloat16 else dtype)
    logged = []
    v = Verifier(TailLoader(torch.device("cpu"), log=logged.append), log=logged.append)
    ready = replies(v, hello_for(good, dtype="bfloat16"), fails=False)
    assert ready[-1].data["dtype"] == "float32" and v.model.dtype is torch.float32
    assert any("no native bfloat16: computing in float32" in line for line in logged), logged
    bf16 = [encode(replace(m, dtype=DType.BFLOAT16, tree=2, hidden=hidden_bytes(torch.frombuffer(
        bytearray(m.hidden), dtype=torch.float32).view(len(m.tokens), 64).to(torch.bfloat16), "x")))
        for m in (decode(fwd[0]), decode(fwd[1]))]
    assert replies(v, bf16[0], fails=False) == []
    (verdict,) = replies(v, bf16[1], fails=False)
    assert list(verdict.tokens) == ref
    assert replies(v, encode(replace(decode(fwd[0]), tree=3)), fails=False) == []
    (verdict,) = replies(v, encode(replace(decode(fwd[1]), tree=3)), fails=False)
    assert list(verdict.tokens) == ref
    half = encode(replace(decode(fwd[0]), tree=4, hidden=bytes(len(PROMPT[:-1]) * 64 * 2), dtype=DType.FLOAT16))
    assert "hidden states of size 64/float16 do not match the tail's 64/float32" in replies(v, half, fails=True)


# -- speculation trees, incrementally ----------------------------------------------------------------
def test_tail_walks_a_tree_down_the_targets_picks_and_answers_its_path(tail_case):
    good, _, ref, _ = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good), fails=False)
    wrong = (ref[0] + 1) % 300
    # root -> (wrong, ref0); ref0 -> ref1 -> (wrong, ref2): the target's path is the root and nodes 3, 4, 6
    nodes = [(0, PROMPT[-1]), (1, wrong), (1, ref[0]), (3, ref[1]), (4, wrong), (4, ref[2])]
    pre, fwd = tree_frames(good, PROMPT, nodes)
    assert replies(v, pre, fails=False) == []
    (verdict,) = replies(v, fwd, fails=False)
    assert verdict.path == (0, 2, 3, 5) and list(verdict.tokens) == ref[:4]
    assert v.model.cached_tokens() == PROMPT + ref[:3]  # the path moved to the positions after the context
    assert v.frontier == (6, ref[3], len(PROMPT) + 2)


def test_a_later_frame_continues_the_walk_and_its_dead_nodes_are_never_computed(tail_case):
    """The second frame was built before the first's verdict: it hangs under several nodes of the
    first. Only the nodes below the target's actual pick run; the verdict continues the walk."""
    good, _, ref, _ = tail_case
    full = greedy_reference(good, PROMPT, 7)
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good), fails=False)
    known = {0: []}
    first = [(0, PROMPT[-1]), (1, full[0]), (2, full[1])]  # the root and a chain of two
    pre, fwd1 = tree_frames(good, PROMPT, first, known=known)
    replies(v, pre, fails=False)
    (v1,) = replies(v, fwd1, fails=False)
    assert v1.path == (0, 1, 2) and list(v1.tokens) == full[:3]
    wrong = (full[2] + 1) % 300
    # under node 3 (full[1]): the pick full[2] and a wrong one, each with a child; under node 2: a stale branch
    second = [(3, wrong), (3, full[2]), (4, 17), (5, full[3]), (2, 99), (7, full[4])]
    (fwd2,) = tree_frames(good, PROMPT, second, first_id=4, rnd=2, known=known, prefill=False)
    computed, skipped = v.computed, v.skipped
    (v2,) = replies(v, fwd2, fails=False)
    assert v.skipped - skipped == 3 and v.computed - computed == 3  # 4, 6 (under 4) and 8 (under the old 2) died
    assert v2.path == (1, 3, 5) and list(v2.tokens) == full[3:6]
    assert v.model.cached_tokens() == PROMPT + full[:5]
    third = [(3, 5)]  # under a node long committed past: dead, nothing computed, an empty verdict
    (fwd3,) = tree_frames(good, PROMPT, third, first_id=10, rnd=3, known=known, prefill=False)
    (v3,) = replies(v, fwd3, fails=False)
    assert v3.path == () and v3.tokens == () and v.computed - computed == 3


def test_frames_of_an_older_tree_are_dropped_unread_and_node_ids_come_in_order(tail_case):
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good), fails=False)
    for raw in fwd:
        replies(v, raw, fails=False)
    written = list(v.model.cached_tokens())
    newer = [encode(replace(decode(raw), tree=2, round=5)) for raw in fwd]
    for raw in newer:
        replies(v, raw, fails=False)
    assert replies(v, fwd[1], fails=False) == [] and v.dropped == 1  # tree 1 is over: dropped, no reply
    assert v.model.cached_tokens() == written
    out_of_order = encode(replace(decode(newer[1]), first_id=9, parents=tuple(p + 8 for p in decode(newer[1]).parents)))
    assert "expected nodes from 5" in replies(v, out_of_order, fails=True)  # K + 1 = 4 nodes came first
    unopened = encode(replace(decode(fwd[1]), tree=3, first_id=2, parents=tuple(p + 1 for p in decode(fwd[1]).parents)))
    assert "after an opening frame" in replies(v, unopened, fails=True)
    too_large = encode(replace(decode(fwd[1]), tree=4, tokens=(1,) * 9, parents=tuple(range(9)),
                               hidden=bytes(9 * 64 * 4)))
    assert "a tree frame of 9 nodes; the hello announced at most 8" in replies(v, too_large, fails=True)


def test_a_heads_nan_states_never_reach_the_next_head(tail_case):
    """A hostile head fills the tail's cache with NaN; the next head (the same model, reused) must get
    exact verdicts: a NaN key in any slot a window covers poisons the softmax, masked or not."""
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good), fails=False)
    nan = torch.full((40, 64), float("nan")).numpy().tobytes()
    replies(v, encode(Forward(1, 1, 0, tuple(range(40)), nan, DType.FLOAT32, 64)), fails=False)
    assert not all(torch.isfinite(k).all() for k in v.model.kv_tensors())
    check_serves(v, good, ref, fwd)


def test_logits_that_overflow_end_the_session_with_the_remedies_instead_of_garbage_tokens(tail_case):
    """A slice whose forward overflows (Qwen2.5 in float16 can: here the states themselves are not
    finite) is caught in the verdict's one host sync: an ERROR naming the layers, the model and the
    dtypes to use, never a verdict of the argmax of NaN."""
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good), fails=False)
    assert replies(v, fwd[0], fails=False) == []  # the prefill
    tree = decode(fwd[1])
    huge = torch.full((len(tree.tokens), 64), float("inf")).numpy().tobytes()
    message = replies(v, encode(replace(tree, hidden=huge)), fails=True)
    assert "layers [2, 4)" in message and "computed logits that are not finite in float32" in message
    assert "--dtype bfloat16" in message and "--dtype float32" in message
    check_serves(v, good, ref, fwd)  # the next head is served exactly



def test_a_tail_whose_gpu_cannot_hold_the_frame_graphs_refuses_the_hello_and_stays_usable(tail_case, monkeypatch):
    """The loader decides the graphs (memory is the node's business): on a GPU it checks them
    first, and the verifier answers its refusal as the head's ERROR, then serves the next hello."""
    import sfchat.node.tail_loader as tail_loader
    from sfchat import UserError
    from tail_cases import K

    good, other, ref, fwd = tail_case
    loader = TailLoader(torch.device("cpu"))
    asked = []

    def refuse(model, shapes):
        asked.append(list(shapes))
        raise UserError("the graphs need 3.0 GiB on cuda:0, 1.0 GiB is free")

    class OnAGpu:
        """The tail's own loader, its slice placed as a GPU tail's (refused before anything runs)."""
        shapes = staticmethod(loader.shapes)

        def __call__(self, hello, progress):
            model = loader(hello, progress)
            model.device = torch.device("cuda")
            return model

    monkeypatch.setattr(tail_loader, "check_graphs", refuse)
    v = Verifier(OnAGpu())
    msg = replies(v, hello_for(good), fails=True)
    assert msg == "tail cannot capture the head's frame shapes: the graphs need 3.0 GiB on cuda:0, 1.0 GiB is free"
    assert asked == [[(K + 1, True), (8, True)]]
    v.load, v.model.device = loader, torch.device("cpu")  # the same verifier and slice, on the CPU again
    check_serves(v, good, ref, fwd)


def test_a_one_shape_hello_makes_every_forward_of_the_tail_run_at_its_frame_shape(tail_case):
    """The prefill too, in pieces of the one row count, padded; the slice refuses any other row
    count, and a hello with another shape loads a slice of that shape, not the one held."""
    good, other, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good, frames=[8], one_shape=True), fails=False)
    assert v.model.rows == 8 and v.model.windows == [v.model.max_len]
    rows = []
    through = type(v.model)._through
    v.model._through = lambda x, *a: rows.append(x.shape[0]) or through(v.model, x, *a)
    check_serves(v, good, ref, fwd, hello=False)
    assert rows and set(rows) == {8}
    held = v.model
    replies(v, hello_for(good, frames=[4], one_shape=True), fails=False)
    assert v.model is not held and v.model.rows == 4
    replies(v, hello_for(good), fails=False)
    assert v.model.rows is None


def test_a_one_shape_tail_refuses_a_frame_deeper_than_its_span_and_serves_one_at_its_edge(tail_case, monkeypatch):
    """Canonical attention reads a row's last SPAN positions as its own: a node SPAN or more past
    the context would read scratch slots as context, so such a frame is refused, plainly."""
    from sfchat.model import kv

    good, other, ref, fwd = tail_case
    monkeypatch.setattr(kv, "SPAN", K + 1)  # the case's chain: K drafts after the root reach K past the context
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good, frames=[8], one_shape=True), fails=False)
    check_serves(v, good, ref, fwd, hello=False)  # the deepest node K past the context: served
    monkeypatch.setattr(kv, "SPAN", K)
    replies(v, hello_for(good, frames=[8], one_shape=True), fails=False)
    assert replies(v, fwd[0], fails=False) == []
    message = replies(v, fwd[1], fails=True)
    assert message == f"a tree frame with a node {K} positions past the context; at most {K - 1} may be"


def test_the_tail_runs_canonical_attention_as_the_heads_hello_says(tail_case, monkeypatch):
    """Compiled canonical attention gives other bits than the plain form (RESULTS, seventh session:
    0 of 6 replies the same), so both halves of a token must run one code: the head's
    ``--compile-attention`` goes in its hello, and the tail sets it before it loads and captures
    the slice. A change of it is a reload (graphs capture the code); an older head's hello, without
    the field, means plain."""
    from sfchat.model import attention

    monkeypatch.setattr(attention, "COMPILE", False)
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    ready = replies(v, hello_for(good, compiled_attention=True), fails=False)[-1]
    assert ready.type is MsgType.READY and not ready.data["reused"] and attention.COMPILE is True
    assert replies(v, hello_for(good, compiled_attention=True), fails=False)[-1].data["reused"]
    ready = replies(v, hello_for(good), fails=False)[-1]  # an older head's hello: plain, and a reload
    assert ready.type is MsgType.READY and not ready.data["reused"] and attention.COMPILE is False
    check_serves(v, good, ref, fwd)  # served exactly


def test_a_heads_compile_attention_goes_in_its_hello(zoo, monkeypatch):
    """The head's setting reaches its tail (here local mode's): the hello names it."""
    from sfchat.config import Settings
    from sfchat.model import attention
    from sfchat.node.head import Head

    monkeypatch.setattr(attention, "COMPILE", False)
    path = str(zoo["qwen2-untied"])
    for on in (True, False):
        session = Head.open(Settings(model=path, draft=path, k=2, device="cpu", compile_attention=on))
        assert session.engine.link.verifier.hello.compiled_attention is on and attention.COMPILE is on


def test_a_tail_reports_capturing_each_frame_shape_and_logs_a_compile(tail_case, monkeypatch):
    """Capturing (and with ``--compile-frames`` compiling) the hello's frame shapes takes a minute
    or more at a first start: the head is told shape by shape (PROGRESS "capture") and the tail's
    log says a compile is under way and how long it took, before READY."""
    import sfchat.node.tail_loader as tail_loader
    from sfchat.node import heap
    from tail_cases import K

    good, *_ = tail_case
    lines, captured, held = [], [], []
    loader = TailLoader(torch.device("cpu"), log=lines.append)

    class OnAGpu:
        """The tail's own loader, its slice placed as a GPU tail's with its forwards compiled whole;
        capturing is recorded (there is no GPU here)."""
        shapes = staticmethod(loader.shapes)

        def __call__(self, hello, progress):
            model = loader(hello, progress)
            model.device, model.compiled = torch.device("cuda"), True
            model.capture = lambda m, n, log=None, tree=False, span=None: captured.append((m, tree))
            held.append(model)
            return model

    import itertools
    import types

    import sfchat.engine.verifier as verifier

    monkeypatch.setattr(tail_loader, "check_graphs", lambda model, shapes: None)
    monkeypatch.setattr(heap, "settle", lambda: None)
    seconds = itertools.count(0, 60)  # a minute between reports, as a compile takes: none held back (10 a second)
    monkeypatch.setattr(verifier, "time", types.SimpleNamespace(monotonic=lambda: next(seconds),
                                                                perf_counter=verifier.time.perf_counter))
    msgs = replies(Verifier(OnAGpu()), hello_for(good), fails=False)
    assert captured == [(K + 1, True), (8, True)]
    progress = [(m.data["done"], m.data["total"], m.data["detail"]) for m in msgs
                if m.type is MsgType.PROGRESS and m.data["stage"] == "capture"]
    windows = len(held[0].windows)
    assert windows == 1  # the CPU's one window
    compiling = "(compiling its forward for 1 attention window: a minute or more at the first start)"
    assert progress == [(0, 2, f"{K + 1}-row tree frame {compiling}"), (1, 2, f"8-row tree frame {compiling}"), (2, 2, "")]
    assert msgs[-1].type is MsgType.READY
    assert [ln for ln in lines if "compil" in ln] == [
        f"{K + 1}-row tree frame {compiling}...", f"the {K + 1}-row frame compiled and captured in 0 s",
        f"8-row tree frame {compiling}...", "the 8-row frame compiled and captured in 0 s"]
