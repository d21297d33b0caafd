"""The tail's reaction to bad frames: one ERROR frame and a TailError, and a Verifier that stays
usable for the next (correct) head."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sfchat.engine.round import hidden_bytes
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.engine.verifier import TailError, Verifier
from sfchat.node.loading import TailLoader
from sfchat.protocol.wire import PROTOCOL_VERSION, Control, DType, Forward, MsgType, Verdict, decode, encode
from test_wire import frame


SPLIT = 2
PROMPT = [3, 17, 42, 99, 5, 250, 7]
K = 3


def hello_for(path, **changes) -> bytes:
    data = {"model": str(path), "revision": None, "split": SPLIT, "dtype": "float32", "max_len": 64,
            "n_layers": 4, "hidden_size": 64, "k": K}
    data.update(changes)
    return encode(Control(MsgType.HELLO, data))


def replies(verifier: Verifier, raw: bytes, fails: bool):
    out: list[bytes] = []
    if fails:
        with pytest.raises(TailError) as info:
            verifier.handle(raw, out.append)
        msgs = [decode(f) for f in out]
        # one ERROR, last; a hello may have reported loading PROGRESS before it
        assert [m.type for m in msgs] == [MsgType.PROGRESS] * (len(msgs) - 1) + [MsgType.ERROR], msgs
        assert msgs[-1].data["message"] == str(info.value)
        return msgs[-1].data["message"]
    verifier.handle(raw, out.append)
    return [decode(f) for f in out]


def greedy_reference(path, ids, n):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return out[0, len(ids):].tolist()


def verify_frame(path, ids, drafts, rnd=1) -> bytes:
    """What a head sends: the head slice's hidden states for the context and K drafts, in one FORWARD."""
    src = ModelSource.open(str(path))
    head = ModelSlice.load(src, 0, SPLIT, embed=True, head=False, dtype=torch.float32,
                           device=torch.device("cpu"), max_len=64)
    seq = ids + drafts
    hidden = head(torch.tensor(seq), torch.arange(len(seq)))
    return encode(Forward(rnd, 0, tuple(seq), hidden_bytes(hidden), DType.FLOAT32, hidden.shape[-1],
                          n_draft=len(drafts)))


@pytest.fixture(scope="module")
def tail_case(zoo):
    """Two same-shaped checkpoints with different weights, and the first one's greedy continuation."""
    good, other = zoo["qwen2-untied"], zoo["qwen2-tied"]
    ref = greedy_reference(good, PROMPT, K + 1)
    assert ref != greedy_reference(other, PROMPT, K + 1)  # else the checks below could not tell them apart
    return good, other, ref, verify_frame(good, PROMPT, ref[:K])


def check_serves(verifier: Verifier, path, ref, forward_frame) -> None:
    ready = replies(verifier, hello_for(path), fails=False)
    assert ready[-1].type is MsgType.READY and ready[-1].data["n_layers"] == 4
    (verdict,) = replies(verifier, forward_frame, fails=False)
    assert isinstance(verdict, Verdict)
    assert verdict.n_accepted == K and list(verdict.tokens) == ref  # all drafts accepted, then the bonus token


def test_tail_refuses_malformed_frames_and_stays_usable(tail_case):
    good, other, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    assert "malformed frame" in replies(v, b"garbage", fails=True)
    assert "bad magic" in replies(v, b"X" * 40, fails=True)
    msg = replies(v, frame(MsgType.HELLO, b"{}", version=PROTOCOL_VERSION + 1), fails=True)
    assert "malformed frame" in msg and "version" in msg
    assert replies(v, fwd, fails=True) == "FORWARD before HELLO"
    assert "unexpected" in replies(v, encode(Verdict(1, 0, 0, (1,))), fails=True)
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
    ({"tree_budget": 257}, "tree_budget=257 out of range 0..256"),
    ({"tree_budget": True}, "tree_budget=True is not of the expected type"),
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
    msg = decode(fwd)
    hole = encode(Forward(1, 5, msg.tokens, msg.hidden, DType.FLOAT32, 64, n_draft=K))
    assert "context hole: the tail holds 0 positions, the head wrote at 5" in replies(v, hole, fails=True)
    narrow = encode(Forward(1, 0, msg.tokens, msg.hidden[: len(msg.tokens) * 32 * 4], DType.FLOAT32, 32))
    assert "do not match" in replies(v, narrow, fails=True)
    half = encode(Forward(1, 0, msg.tokens, msg.hidden[: len(msg.tokens) * 64 * 2], DType.FLOAT16, 64))
    assert "do not match" in replies(v, half, fails=True)
    late = encode(Forward(1, 60, msg.tokens, msg.hidden, DType.FLOAT32, 64))
    assert "exceed the context of 64" in replies(v, late, fails=True)
    (verdict,) = replies(v, fwd, fails=False)  # the refusals left no trace in the cache
    assert list(verdict.tokens) == ref
    # a prefill that fills positions 0..n-1 makes n the next legal start, n + 1 a hole
    n = len(PROMPT)
    prefill = encode(Forward(2, 0, msg.tokens[:n], msg.hidden[: n * 64 * 4], DType.FLOAT32, 64,
                             want_verdict=False))
    assert replies(v, prefill, fails=False) == []
    after = encode(Forward(3, n + 1, msg.tokens[:1], msg.hidden[: 64 * 4], DType.FLOAT32, 64))
    assert "context hole" in replies(v, after, fails=True)


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
    import sfchat.node.loading as tail_module

    good, _, ref, fwd = tail_case
    monkeypatch.setattr(tail_module, "runnable_dtype",
                        lambda device, dtype: torch.float32 if dtype is torch.bfloat16 else dtype)
    logged = []
    v = Verifier(TailLoader(torch.device("cpu"), log=logged.append), log=logged.append)
    ready = replies(v, hello_for(good, dtype="bfloat16"), fails=False)
    assert ready[-1].data["dtype"] == "float32" and v.model.dtype is torch.float32
    assert any("no native bfloat16: computing in float32" in line for line in logged), logged
    msg = decode(fwd)
    n = len(msg.tokens)
    bf16 = torch.frombuffer(bytearray(msg.hidden), dtype=torch.float32).view(n, 64).to(torch.bfloat16)
    sent = encode(Forward(1, 0, msg.tokens, hidden_bytes(bf16), DType.BFLOAT16, 64, n_draft=K))
    (verdict,) = replies(v, sent, fails=False)
    assert list(verdict.tokens) == ref
    # the tail's own dtype is accepted too; anything else is still refused
    (verdict,) = replies(v, fwd, fails=False)
    assert list(verdict.tokens) == ref
    half = encode(Forward(1, 0, msg.tokens, bytes(n * 64 * 2), DType.FLOAT16, 64, n_draft=K))
    assert "hidden states of size 64/float16 do not match the tail's 64/float32" in replies(v, half, fails=True)


# -- token trees ------------------------------------------------------------------------------------
def tree_frame(path, ids, parents, nodes, rnd=1) -> bytes:
    """What a head sends a fresh tail for a tree round: the context but t0 as a prefill FORWARD,
    then t0 and the nodes (with the tree mask) as the tree FORWARD."""
    from sfchat.engine import tree as trees

    src = ModelSource.open(str(path))
    head = ModelSlice.load(src, 0, SPLIT, embed=True, head=False, dtype=torch.float32,
                           device=torch.device("cpu"), max_len=64)
    n = len(ids)
    pre = head(torch.tensor(ids[:-1]), torch.arange(n - 1))
    hid = head(torch.tensor(ids[-1:] + nodes), torch.arange(n - 1, n + len(nodes)),
               tree=trees.mask(parents, n - 1, "cpu"))
    return (encode(Forward(rnd, 0, tuple(ids[:-1]), hidden_bytes(pre), DType.FLOAT32, pre.shape[-1],
                           want_verdict=False)),
            encode(Forward(rnd, n - 1, tuple(ids[-1:] + nodes), hidden_bytes(hid), DType.FLOAT32, hid.shape[-1],
                           n_draft=len(nodes), parents=tuple(parents))))


def test_tail_verifies_a_tree_and_answers_its_path(tail_case):
    good, _, ref, _ = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good, tree_budget=5), fails=False)
    wrong = (ref[0] + 1) % 300
    # t0 -> (wrong, ref0); ref0 -> ref1 -> (wrong, ref2): the target's path is nodes 2, 3, 5
    pre, fwd = tree_frame(good, PROMPT, [0, 0, 2, 3, 3], [wrong, ref[0], ref[1], wrong, ref[2]])
    assert replies(v, pre, fails=False) == []
    (verdict,) = replies(v, fwd, fails=False)
    assert verdict.path == (2, 3, 5) and list(verdict.tokens) == ref[:4]
    assert v.model.kv.written == PROMPT + ref[:3]  # the path moved to the positions after the context


@pytest.mark.parametrize("budget, k, message", [
    (4, K, "a tree of 5 nodes; the hello announced at most 4"),
    (5, 2, "a tree 3 deep; the hello announced at most 2"),
    (0, K, "a tree of 5 nodes; the hello announced at most 0"),
])
def test_tail_refuses_a_tree_larger_than_the_hello_allows(tail_case, budget, k, message):
    good, _, ref, _ = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good, tree_budget=budget, k=k), fails=False)
    pre, fwd = tree_frame(good, PROMPT, [0, 0, 2, 3, 3], [1, ref[0], ref[1], 2, ref[2]])
    replies(v, pre, fails=False)
    assert replies(v, fwd, fails=True) == message
    check_serves(v, good, ref, tail_case[3])  # and it serves the next head
