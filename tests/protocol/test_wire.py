"""The wire codec: round trips, fuzzing (only WireError may come out), specific rejections."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sfchat.protocol import wire
from sfchat.protocol.wire import (
    FORWARD_FIXED, HEADER, PROTOCOL_VERSION, VERDICT_FIXED, Control, DType, Forward, MsgType, Sampling,
    Verdict, WireError, decode, encode,
)

from wire_frames import frame


def fuzz(n: int):
    """Bounded, derandomized (the same cases on every run) and without a deadline."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def forward_body(n_tok: int, hsize: int, *, tree: bool = False, first_id: int = 0, dtype: int = DType.FLOAT32,
                 temp: float = 0.0, top_p: float = 1.0, hidden_bytes_: int | None = None, parents=None,
                 penalty: float = 1.0) -> bytes:
    fixed = FORWARD_FIXED.pack(1, 0, n_tok, first_id, dtype, hsize, temp, 0, top_p, 0, penalty)
    hidden = bytes(n_tok * hsize * 4 if hidden_bytes_ is None else hidden_bytes_)
    ids = struct.pack(f"<{n_tok}i", *range(n_tok))
    parents = struct.pack(f"<{n_tok}I", *(parents or [0] * n_tok)) if tree else b""
    return fixed + ids + parents + hidden


# -- round trips ------------------------------------------------------------------------------

EXAMPLES = [
    Control(MsgType.HELLO, {"model": "Qwen/Qwen2.5-7B-Instruct", "split": 14, "revision": None, "k": 8}),
    Control(MsgType.READY, {"n_layers": 28, "reused": True, "load_s": 1.5}, round=3),
    Control(MsgType.PROGRESS, {"stage": "download", "done": 1, "total": 4, "detail": "model-0001.safetensors"}),
    Control(MsgType.ERROR, {"message": "ünïcødé: not the same model"}),
    Control(MsgType.BYE),
    # a prefill chunk: no nodes, no verdict wanted
    Forward(round=1, tree=1, start_pos=0, tokens=(5, 6, 7), hidden=bytes(range(3 * 4 * 4)), dtype=DType.FLOAT32,
            hidden_size=4),
    # a tree's first frame: the root (its parent 0, the context), two children, a grandchild
    Forward(round=2, tree=1, start_pos=3, tokens=(1, 2, 3, 4), hidden=b"\x01\x02" * 4 * 2, dtype=DType.BFLOAT16,
            hidden_size=2, parents=(0, 1, 1, 3), first_id=1),
    # a later frame, sampled, hanging under nodes of the first
    Forward(round=2**32 - 1, tree=2**32 - 1, start_pos=2**32 - 1, tokens=(-(2**31), 2**31 - 1), hidden=b"\xff" * 4,
            dtype=DType.FLOAT16, hidden_size=1, parents=(4, 5), first_id=5, sampling=Sampling(0.75, 40, 0.875, 2**64 - 1)),
    Verdict(round=7, tree=1, path=(), tokens=()),
    Verdict(round=9, tree=1, path=(0, 2), tokens=(3, 42), tail_us=5),
    Verdict(round=8, tree=3, path=tuple(range(wire.MAX_DEPTH)), tokens=tuple(range(wire.MAX_DEPTH)), tail_us=123456),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(msg):
    raw = encode(msg)
    assert decode(raw) == msg
    assert encode(decode(raw)) == raw
    assert decode(bytearray(raw)) == msg and decode(memoryview(raw)) == msg
    assert len(raw) <= wire.max_frame_size(64)


f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def forwards(draw):
    n = draw(st.integers(1, 12))
    h = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(list(DType)))
    tree = draw(st.booleans())
    first = draw(st.integers(1, 2**20)) if tree else 0
    parents = tuple(draw(st.integers(max(0, first + i - 3), first + i - 1)) for i in range(n)) if tree else None
    return Forward(
        round=draw(u32), tree=draw(u32), start_pos=draw(u32), tokens=tuple(draw(st.lists(i32, min_size=n, max_size=n))),
        hidden=draw(st.binary(min_size=n * h * dtype.itemsize, max_size=n * h * dtype.itemsize)),
        dtype=dtype, hidden_size=h, parents=parents, first_id=first,
        sampling=Sampling(draw(f32.filter(lambda x: x >= 0)), draw(u32),
                          draw(f32.filter(lambda x: 0 < x <= 1)), draw(st.integers(0, 2**64 - 1)),
                          draw(st.floats(*wire.REPETITION_PENALTY))),
    )


@st.composite
def verdicts(draw):
    path = tuple(sorted(set(draw(st.lists(st.integers(0, 255), max_size=wire.MAX_DEPTH)))))
    tokens = tuple(draw(st.lists(i32, min_size=len(path), max_size=len(path))))
    return Verdict(draw(u32), draw(u32), path, tokens, draw(u32))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6)
controls = st.builds(Control, st.sampled_from(sorted(wire.JSON_TYPES)),
                     st.dictionaries(st.text(max_size=6), json_values, max_size=4), u32)
messages = forwards() | verdicts() | controls


@fuzz(200)
@given(messages)
def test_random_valid_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


# -- fuzzing: only WireError may come out -------------------------------------------------------

def decodes_or_wire_error(raw: bytes) -> None:
    """decode either refuses with WireError or gives a message that encodes back to a valid frame."""
    try:
        msg = decode(raw)
    except WireError:
        return
    again = encode(msg)
    assert encode(decode(again)) == again


@fuzz(1000)
@given(st.binary(max_size=256))
def test_decode_of_arbitrary_bytes(raw):
    decodes_or_wire_error(raw)


@fuzz(800)
@given(st.sampled_from([PROTOCOL_VERSION] * 6 + [0, 1, 3, 255]), st.integers(0, 255), st.integers(0, 2**16 - 1),
       u32, st.binary(max_size=300), st.none() | u32)
def test_decode_of_arbitrary_bodies_behind_a_plausible_header(version, mtype, flags, rnd, body, body_len):
    decodes_or_wire_error(frame(mtype, body, version=version, flags=flags, rnd=rnd, body_len=body_len))


mutations = st.lists(st.tuples(st.sampled_from(["flip", "truncate", "u32", "u8", "insert", "delete"]),
                               st.integers(0, 2**16), st.integers(0, 2**32 - 1)), min_size=1, max_size=4)


def mutate(raw: bytes, edits) -> bytes:
    b = bytearray(raw)
    for kind, pos, value in edits:
        i = pos % (len(b) + 1)
        if kind == "flip" and b:
            b[i % len(b)] ^= 1 << (value % 8)
        elif kind == "truncate":
            del b[i:]
        elif kind == "u32":  # a length/count field edit: body_len sits at 12, FORWARD counts at 16..40
            j = min(i, max(len(b) - 4, 0)) & ~3
            b[j:j + 4] = struct.pack("<I", value)
        elif kind == "u8":
            if b:
                b[i % len(b)] = value & 0xFF
        elif kind == "insert":
            b[i:i] = struct.pack("<I", value)[: 1 + value % 4]
        elif kind == "delete":
            del b[i:i + 1 + value % 8]
    return bytes(b)


VALID_FRAMES = [encode(m) for m in EXAMPLES]


@fuzz(1500)
@given(st.sampled_from(VALID_FRAMES), mutations, st.booleans())
def test_decode_of_mutated_valid_frames(valid, edits, fix_length):
    raw = mutate(valid, edits)
    if fix_length and len(raw) >= HEADER.size:  # keep body_len consistent so the body parsers get fuzzed
        raw = raw[:12] + struct.pack("<I", len(raw) - HEADER.size) + raw[16:]
    decodes_or_wire_error(raw)


@fuzz(400)
@given(st.sampled_from([m for m in EXAMPLES if not isinstance(m, Control)]),
       st.integers(0, 10), st.integers(0, 2**32 - 1))
def test_decode_of_frames_with_one_header_field_replaced(msg, field, value):
    """Every 32-bit slot of the FORWARD / VERDICT fixed part set to an arbitrary value, body_len kept right."""
    raw = bytearray(encode(msg))
    off = HEADER.size + 4 * field
    if off + 4 <= len(raw):
        raw[off:off + 4] = struct.pack("<I", value)
    decodes_or_wire_error(bytes(raw))


# -- specific rejections ---------------------------------------------------------------------------

VALID_FORWARD = encode(EXAMPLES[6])  # a tree frame


DECODE_REJECTIONS = [
    (b"", "shorter than the header"),
    (VALID_FORWARD[:HEADER.size - 1], "shorter than the header"),
    (b"ZZZZ" + VALID_FORWARD[4:], "bad magic"),
    (frame(MsgType.HELLO, b"{}", version=1), "protocol version 1 is not supported"),
    (frame(MsgType.HELLO, b"{}", version=0), "version 0"),
    (frame(99, b"{}"), "unknown message type 99"),
    (frame(0, b""), "unknown message type 0"),
    (frame(MsgType.HELLO, b"{}", body_len=3), "announces 3 body bytes, frame has 2"),
    (VALID_FORWARD + b"\x00", "announces"),
    (VALID_FORWARD[:-1], "announces"),
    (frame(MsgType.HELLO, b"[1, 2]"), "HELLO body must be a JSON object"),
    (frame(MsgType.READY, b'"text"'), "READY body must be a JSON object"),
    (frame(MsgType.ERROR, b"null"), "must be a JSON object"),
    (frame(MsgType.HELLO, b"{not json"), "HELLO body is not JSON"),
    (frame(MsgType.HELLO, b'{"a": "\xff"}'), "not JSON"),
    (frame(MsgType.HELLO, b"[" * 100000), "too large"),
    (frame(MsgType.HELLO, b"[" * 60000), "not JSON"),  # RecursionError inside json
    (frame(MsgType.HELLO, b'{"a": ' + b"1" * 5000 + b"}"), "not JSON"),  # int beyond Python's digit limit
    (frame(MsgType.FORWARD, forward_body(0, 2)), "FORWARD with 0 tokens"),
    (frame(MsgType.FORWARD, forward_body(0, 2, tree=True, first_id=1), flags=wire.FLAG_VERDICT), "0 nodes"),
    (frame(MsgType.FORWARD, forward_body(wire.MAX_NODES + 1, 1, tree=True, first_id=1), flags=wire.FLAG_VERDICT),
     f"FORWARD with {wire.MAX_NODES + 1} nodes"),
    (frame(MsgType.FORWARD, forward_body(2, 1, tree=True, first_id=0), flags=wire.FLAG_VERDICT), "first node id is 0"),
    (frame(MsgType.FORWARD, forward_body(2, 1, first_id=3)), "a prefill FORWARD with node ids"),
    (frame(MsgType.FORWARD, forward_body(2, 1, tree=True, first_id=4, parents=[3, 5]), flags=wire.FLAG_VERDICT),
     "node 5 names parent 5: a parent must come before its node"),
    (frame(MsgType.FORWARD, forward_body(1, 0)), "hidden size 0 out of range"),
    (frame(MsgType.FORWARD, forward_body(2, 4, hidden_bytes_=2 * 4 * 4 - 1)), "body length does not match"),
    (frame(MsgType.FORWARD, forward_body(2, 4, hidden_bytes_=2 * 4 * 2)), "body length does not match"),
    (frame(MsgType.FORWARD, forward_body(2, 4, tree=True, first_id=1), flags=0), "a prefill FORWARD with node ids"),
    (frame(MsgType.FORWARD, forward_body(2, 4, dtype=9)), "unknown hidden dtype code 9"),
    (frame(MsgType.FORWARD, forward_body(2, 4, temp=float("nan"))), "sampling parameters out of range"),
    (frame(MsgType.FORWARD, forward_body(2, 4, temp=-1.0)), "sampling parameters out of range"),
    (frame(MsgType.FORWARD, forward_body(2, 4, top_p=0.0)), "sampling parameters out of range"),
    (frame(MsgType.FORWARD, forward_body(2, 4, penalty=0.0)), "repetition penalty 0.0 is not between 0.01 and 10"),
    (frame(MsgType.FORWARD, forward_body(2, 4, penalty=10.5)), "repetition penalty 10.5 is not between 0.01 and 10"),
    (frame(MsgType.FORWARD, forward_body(2, 4, penalty=float("nan"))), "repetition penalty nan is not between"),
    (frame(MsgType.FORWARD, forward_body(2, 4), version=4), r"protocol version 4 is not supported \(this side speaks 5\)"),
    (frame(MsgType.FORWARD, b"\x00" * (FORWARD_FIXED.size - 1)), "FORWARD body too short"),
    (frame(MsgType.VERDICT, VERDICT_FIXED.pack(0, 2, 0) + struct.pack("<2H2i", 0, 1, 1, 2)[:-1]), "VERDICT body length"),
    (frame(MsgType.VERDICT, VERDICT_FIXED.pack(0, wire.MAX_DEPTH + 1, 0)), f"path of {wire.MAX_DEPTH + 1} nodes"),
    (frame(MsgType.VERDICT, VERDICT_FIXED.pack(0, 2, 0) + struct.pack("<2H2i", 1, 1, 1, 2)), "ascending"),
    (frame(MsgType.VERDICT, b"\x00" * 8), "VERDICT body too short"),
]


@pytest.mark.parametrize("raw, message", DECODE_REJECTIONS, ids=[m for _, m in DECODE_REJECTIONS])
def test_decode_rejects_with_a_message(raw, message):
    with pytest.raises(WireError, match=message):
        decode(raw)


def test_decode_rejects_non_bytes():
    with pytest.raises(WireError, match="expected a binary frame, got str"):
        decode("SFCH")  # type: ignore[arg-type]


H4 = bytes(2 * 4 * 4)


def tree(parents, first_id=1, **kw) -> Forward:
    n = len(parents)
    return Forward(round=1, tree=1, start_pos=4, tokens=tuple(range(n)), hidden=bytes(2 * n), dtype=DType.FLOAT16,
                   hidden_size=1, parents=tuple(parents), first_id=first_id, **kw)


ENCODE_REFUSALS = [
    (Forward(1, 1, 0, (1, 2), H4[:-1], DType.FLOAT32, 4), "hidden payload is 31 bytes, expected 32"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT16, 4), "hidden payload is 32 bytes, expected 16"),
    (Forward(1, 1, 0, (), b"", DType.FLOAT32, 4), "FORWARD with 0 tokens"),
    (Forward(1, 1, 0, (1, 2**31), H4, DType.FLOAT32, 4), "tokens"),
    (Forward(-1, 1, 0, (1, 2), H4, DType.FLOAT32, 4), "cannot encode"),
    (Forward(1, 1, -5, (1, 2), H4, DType.FLOAT32, 4), "cannot encode"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, sampling=Sampling(temperature=float("nan"))), "sampling"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, sampling=Sampling(temperature=-0.5)), "sampling"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, sampling=Sampling(top_p=0.0)), "sampling"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, sampling=Sampling(top_k=-1)), "cannot encode"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, sampling=Sampling(repetition_penalty=0.0)), "repetition penalty"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, sampling=Sampling(repetition_penalty=1e300)), "repetition penalty"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, parents=(0,), first_id=1), "a tree frame of 2 nodes with 1 parents"),
    (tree([0, 1], first_id=0), "first node id is 0"),
    (tree([0, 2]), "node 2 names parent 2"),
    (Forward(1, 1, 0, (1, 2), H4, DType.FLOAT32, 4, first_id=2), "a prefill FORWARD with node ids"),
    (Verdict(1, 0, (0, 1), (1,)), "one per token"),
    (Verdict(1, 0, (1, 0), (1, 2)), "ascending"),
    (Verdict(1, 0, (0,), (2**31,)), "tokens"),
    (Verdict(1, 0, (70000,), (1,)), "path"),
    (Verdict(1, 0, (0,), (1,), tail_us=-1), "cannot encode"),
    (Control(MsgType.FORWARD, {}), "FORWARD is not a JSON message type"),
    (Control(MsgType.VERDICT, {}), "not a JSON message type"),
    (Control(MsgType.HELLO, [1, 2]), "must be a JSON object"),  # type: ignore[arg-type]
    (Control(MsgType.HELLO, {"t": torch.zeros(1)}), "not JSON"),
    (Control(MsgType.HELLO, {"blob": "x" * wire.MAX_JSON_BYTES}), "exceeds"),
    (Control(MsgType.BYE, {}, round=2**32), "cannot encode"),
    ("hello", "cannot encode str"),
]


@pytest.mark.parametrize("msg, message", ENCODE_REFUSALS, ids=[m for _, m in ENCODE_REFUSALS])
def test_encode_refuses_inconsistent_messages(msg, message):
    with pytest.raises(WireError, match=message):
        encode(msg)


@st.composite
def sloppy_messages(draw):
    """Messages whose fields may disagree with each other or overflow their wire fields."""
    ints = st.integers(-3, 5) | st.integers(-(2**65), 2**65)
    kind = draw(st.sampled_from(["forward", "verdict", "control"]))
    if kind == "verdict":
        n = draw(st.integers(0, 70))
        return Verdict(draw(ints), draw(ints), tuple(draw(st.lists(ints, max_size=n))),
                       tuple(draw(st.lists(ints, max_size=70))), draw(ints))
    if kind == "control":
        return Control(draw(st.sampled_from(list(MsgType))), draw(st.dictionaries(st.text(max_size=3), json_values,
                                                                                   max_size=3)), draw(ints))
    n = draw(st.integers(0, 5))
    h = draw(st.integers(0, 5))
    parents = None if draw(st.booleans()) else tuple(draw(st.lists(ints, max_size=6)))
    return Forward(draw(ints), draw(ints), draw(ints), tuple(draw(st.lists(ints, min_size=n, max_size=n))),
                   bytes(draw(st.integers(0, 4 * n * max(h, 1) + 2))), draw(st.sampled_from(list(DType))), h,
                   parents=parents, first_id=draw(ints),
                   sampling=Sampling(draw(st.floats(width=32) | st.floats()), draw(ints), draw(st.floats()), draw(ints)))


@fuzz(300)
@given(sloppy_messages())
def test_encode_gives_a_decodable_frame_or_wire_error(msg):
    try:
        raw = encode(msg)
    except WireError:
        return
    assert encode(decode(raw)) == raw


def test_error_frames_are_json_objects():
    raw = encode(Control(MsgType.ERROR, {"message": "x"}))
    assert json.loads(raw[HEADER.size:]) == {"message": "x"}


# -- speculation trees (protocol version 4) --------------------------------------------------------
def test_a_frame_lies_at_most_max_depth_below_the_nodes_outside_it():
    deep = list(range(wire.MAX_DEPTH))  # node 1 under the root, node 2 under node 1, ...
    assert wire.frame_depths(deep, 1) == list(range(1, wire.MAX_DEPTH + 1))
    assert decode(encode(tree(deep))).parents == tuple(deep)
    with pytest.raises(wire.TreeError, match=f"deeper than {wire.MAX_DEPTH}"):
        encode(tree(deep + [wire.MAX_DEPTH]))
    # the same chain continued in a later frame: its depth counts from the nodes outside that frame
    assert wire.frame_depths(list(range(100, 100 + wire.MAX_DEPTH)), 101)[-1] == wire.MAX_DEPTH
    wide = [0] * wire.MAX_NODES
    assert len(decode(encode(tree(wide))).tokens) == wire.MAX_NODES


def test_every_verdict_fits_one_padded_size():
    """The largest verdict stays under the sealed link's smallest padded size, so the relay cannot
    tell how many tokens a frame committed from its verdict's length."""
    from sfchat.link.padding import MIN_PADDED

    largest = encode(Verdict(2**32 - 1, 2**32 - 1, tuple(range(wire.MAX_DEPTH)), (2**31 - 1,) * wire.MAX_DEPTH,
                             2**32 - 1))
    assert len(largest) + 1 < MIN_PADDED
