"""10,000 seeded hostile frames into one Verifier on a tiny model: every frame is either served or
refused with one ERROR (a TailError), never another exception, never the catch-all's "failed on
this frame"; every VERDICT is well formed; afterwards the same Verifier serves an honest head.

The frames are built to get past the decoder (their lengths agree with their headers) so that
the Verifier's own checks and the model are reached: tree frames whose node ids, parents and
trees are mostly what the tail expects (parents at the frontier, in the frame, in earlier frames,
dead, pruned, or unknown; ids in order or not; frames of older, current and newer trees; frames at
the size limits), prefill frames; and then some are broken at the byte level."""

from __future__ import annotations

import json
import random
import struct

import torch

from sfchat.protocol import wire
from sfchat.model import source
from sfchat.engine.verifier import UNEXPECTED, TailError, Verifier
from sfchat.node.tail_loader import TailLoader
from sfchat.protocol.wire import FORWARD_FIXED, HEADER, MAGIC, PROTOCOL_VERSION, MsgType

from tail_cases import K, check_serves, hello_for, tail_case  # noqa: F401  (the tail_case fixture)

N_FRAMES = 10_000
SEED = 20_261_201
RAW_VALUES = ["Infinity", "-Infinity", "NaN", "1e999", "-1e999", "1" + "0" * 400, "[]", "{}", "null", "true",
              "false", '"x"', '""', "-1", "0", "1", "1.5", "2", "64", "65", "2147483648", "18446744073709551616",
              '"float32"', '"bfloat16"', '"nf4"', '"/etc"', '"../../etc/passwd"', '"\\u001b[2J"',
              "[" * 3000 + "]" * 3000, '{"a": [1, {"b": null}]}', "4096", "1e308", "-0.0"]
TEMPERATURES = [0.0, 0.0, 0.7, 1.0, 1e-300, 1e300, 5e-324, 0.5, 2.0]
BAD_FLOATS = [float("inf"), float("nan"), -1.0, 0.0, 2.0, -0.0]


class Fuzzer:
    def __init__(self, rng: random.Random, hello: dict, vocab: int, hidden: int):
        self.rng, self.hello, self.vocab, self.hidden = rng, hello, vocab, hidden
        self.recent: list[bytes] = []

    def frame(self, v: Verifier) -> bytes:
        r = self.rng.random()
        if r < 0.03:
            raw = wire.encode(wire.Control(MsgType.HELLO, self.hello))
        elif r < 0.06:
            raw = self.hello_frame()
        elif r < 0.76:
            raw = self.forward_frame(v)
        elif r < 0.92 and self.recent:
            raw = self.broken(self.rng.choice(self.recent))
        else:
            raw = self.other_frame()
        self.recent = (self.recent + [raw])[-32:]
        return raw

    def hello_frame(self) -> bytes:
        fields = {k: json.dumps(v) for k, v in self.hello.items()}
        for _ in range(self.rng.randint(1, 2)):
            key = self.rng.choice(list(fields) + ["graphs", "quant", "extra"])
            if self.rng.random() < 0.2:
                fields.pop(key, None)
            else:
                fields[key] = self.rng.choice(RAW_VALUES)
        body = ("{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields.items()) + "}").encode()
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.HELLO, 0, 0, len(body)) + body

    def forward_frame(self, v: Verifier) -> bytes:
        rng = self.rng
        written = len(v.model.cached_tokens()) if v.model is not None else 0
        max_len = v.model.max_len if v.model is not None else 64
        tree = rng.random() < 0.75
        tree_id = v.tree + rng.choice([0, 0, 0, 0, 1, 1, -1, 5]) if rng.random() < 0.97 else rng.getrandbits(32)
        tree_id = max(tree_id, 0)
        if tree:
            n = rng.choice([1, 2, 3, K + 1, K + 1, 8, 8]) if rng.random() < 0.95 else rng.choice([9, 0, wire.MAX_NODES])
            opening = tree_id > v.tree or v.frontier is None or rng.random() < 0.05
            first = 1 if opening else (v.next_id if rng.random() < 0.9 else rng.randint(1, v.next_id + 10))
            start = written if opening and rng.random() < 0.9 else (v.root_pos if rng.random() < 0.9 else
                                                                    rng.randint(0, max_len + 2))
            frontier = v.frontier[0] if v.frontier is not None and not opening else 0
            parents = []
            for i in range(max(n, 0)):
                node = first + i
                choice = rng.random()
                if choice < 0.35:
                    parent = frontier
                elif choice < 0.75 and i:
                    parent = rng.randint(first, node - 1)  # in this frame
                elif choice < 0.9:
                    parent = rng.randint(0, max(node - 1, 0))  # anywhere before: dead or pruned, often
                else:
                    parent = rng.choice([node, node + 5, 2 ** 32 - 1])  # unknown: the decoder refuses
                parents.append(parent)
        else:
            n = rng.choice([1, 2, 3, 8, 20]) if rng.random() < 0.95 else rng.choice([0, wire.MAX_TOKENS_PER_FRAME + 1])
            first, parents = 0, []
            room = max(max_len - max(n, 1), 0)
            start = rng.randint(0, min(written, room)) if rng.random() < 0.85 else \
                rng.choice([written + 1, max_len, 2 ** 32 - 1, room + 1])
        dtype = wire.DType.FLOAT32 if rng.random() < 0.95 else rng.choice([1, 2, 3, 0, 9])
        hsize = self.hidden if rng.random() < 0.95 else rng.choice([1, 32, wire.MAX_HIDDEN_SIZE + 1, 0])
        temp = rng.choice(TEMPERATURES) if rng.random() < 0.95 else rng.choice(BAD_FLOATS)
        top_p = rng.choice([1.0, 1.0, 0.9, 0.5, 1e-9]) if rng.random() < 0.95 else rng.choice(BAD_FLOATS)
        top_k = rng.choice([0, 0, 1, 5, 2 ** 32 - 1])
        seed = rng.getrandbits(64)
        penalty = rng.choice([1.0, 1.0, 1.3, 0.5, 10.0]) if rng.random() < 0.95 else rng.choice(BAD_FLOATS + [0.0, 11.0])
        try:
            fixed = FORWARD_FIXED.pack(tree_id, start, max(n, 0), first, dtype, max(hsize, 0), temp, top_k, top_p, seed,
                                       penalty)
        except struct.error:
            return self.other_frame()
        pick = v.frontier[1] if v.frontier is not None else 0
        tokens = [(pick if tree and i == 0 and rng.random() < 0.6 else rng.randrange(self.vocab))
                  if rng.random() < 0.9 else rng.randint(-2 ** 31, 2 ** 31 - 1) for i in range(max(min(n, 300), 0))]
        itemsize = {1: 4, 2: 2, 3: 2}.get(dtype, 4)
        if rng.random() < 0.8:
            hidden = struct.pack(f"<{len(tokens) * hsize}f", *(rng.gauss(0, 1) for _ in range(len(tokens) * hsize))) \
                if itemsize == 4 and 0 < hsize <= self.hidden else rng.randbytes(len(tokens) * max(hsize, 0) * itemsize)
        else:  # raw bytes: NaN, infinities, denormals among them
            hidden = rng.randbytes(len(tokens) * max(hsize, 0) * itemsize)
        try:
            ids = struct.pack(f"<{len(tokens)}I", *parents[:len(tokens)]) if tree else b""
        except struct.error:
            return self.other_frame()
        body = fixed + struct.pack(f"<{len(tokens)}i", *tokens) + ids + hidden
        flags = wire.FLAG_VERDICT if tree else 0
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.FORWARD, flags, rng.getrandbits(32), len(body)) + body

    def broken(self, raw: bytes) -> bytes:
        rng = self.rng
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            what = rng.random()
            if what < 0.5 and data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif what < 0.7:
                del data[rng.randrange(len(data) + 1):]
            elif what < 0.85:
                data += rng.randbytes(rng.randint(1, 16))
            elif len(data) >= HEADER.size + FORWARD_FIXED.size:  # a header or FORWARD field at an edge value
                offset = rng.choice([4, 5, 6, 12, 13, 14, 15, 16, 19, 20, 23, 24, 27, 28, 31, 32, 36, 45, 49])
                data[offset] = rng.choice([0, 1, 0x7F, 0xFF])
        return bytes(data)

    def other_frame(self) -> bytes:
        rng = self.rng
        choice = rng.randrange(5)
        if choice == 0:
            return rng.randbytes(rng.randint(0, 64))
        if choice == 1:
            return wire.encode(wire.Control(rng.choice([MsgType.READY, MsgType.PROGRESS, MsgType.ERROR, MsgType.BYE]),
                                            {"message": "x"}))
        if choice == 2:
            return wire.encode(wire.Verdict(1, 0, (0,), (rng.randrange(self.vocab),)))
        if choice == 3:
            body = rng.randbytes(rng.randint(0, 40))
            return HEADER.pack(MAGIC, rng.choice([0, 1, 3, 255]), rng.randint(0, 255), 0, 0, len(body)) + body
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.HELLO, 0, 0, 5) + b"\xff\xfe{}x"


def test_the_tail_survives_ten_thousand_hostile_frames_with_protocol_errors_only(tail_case, monkeypatch):
    good, _, ref, fwd = tail_case
    monkeypatch.setattr(source, "hub_unreachable", lambda: "no network in this test")  # hub ids: cache only
    v = Verifier(TailLoader(torch.device("cpu"), models_dirs=[good.parent]))
    hello = dict(wire.decode(hello_for(good)).data)
    check_serves(v, good, ref, fwd)
    vocab = v.model.config.vocab_size
    fuzzer = Fuzzer(random.Random(SEED), hello, vocab, v.model.config.hidden_size)
    served = refused = verdicts = committed = 0
    messages: dict[str, int] = {}
    for _ in range(N_FRAMES):
        out: list[bytes] = []
        try:
            v.handle(fuzzer.frame(v), out.append)
            served += 1
        except TailError as exc:
            refused += 1
            kind = str(exc).split(":")[0][:40]
            messages[kind] = messages.get(kind, 0) + 1
            assert wire.decode(out[-1]).type is MsgType.ERROR
        for raw in out:
            msg = wire.decode(raw)
            if isinstance(msg, wire.Verdict):
                verdicts += 1
                assert len(msg.path) <= 8 and all(0 <= t < vocab for t in msg.tokens), msg
                committed += len(msg.path)
            else:
                assert msg.type in (MsgType.READY, MsgType.PROGRESS, MsgType.ERROR), msg
                assert not str(msg.data.get("message", "")).startswith(UNEXPECTED), msg.data
    assert served + refused == N_FRAMES
    assert verdicts >= 500 and refused >= 3000, (served, refused, verdicts, messages)  # both paths ran
    assert committed >= 200 and v.skipped >= 1000 and v.dropped >= 50, (committed, v.skipped, v.dropped)
    assert len(messages) >= 8, messages
    check_serves(v, good, ref, fwd)
