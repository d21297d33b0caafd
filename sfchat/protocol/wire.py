"""The sfchat wire format: versioned binary frames exchanged by head and tail.

Contract
--------
Every frame is ``HEADER`` (fixed ``struct``) followed by a body of ``body_len`` bytes::

    magic  4s   b"SFCH"
    version B   PROTOCOL_VERSION
    type    B   MsgType
    flags   H   per-type bit flags (FLAG_*)
    round   I   round id chosen by the head (echoed by the tail)
    body    I   body length in bytes

Bodies:

* HELLO, READY, PROGRESS, ERROR, BYE: UTF-8 JSON objects of metadata only (model id,
  split, K, stage names...). Never tensors. Strict JSON: ``NaN``, ``Infinity`` and numbers
  that overflow a double (``1e999``) are refused, as RFC 8259 has no such values
  (``to_json`` and ``from_json``, which the chat protocol's frames use too).
* FORWARD (head -> tail) comes in two kinds. A prefill FORWARD (no flag) carries a run of
  consecutive positions from ``start_pos``: the tail only fills its KV cache. A tree FORWARD
  (FLAG_VERDICT) carries the next nodes of a speculation tree (see ``engine/live.py``): node ids
  ``first_id, first_id + 1, ...``, each node's token and the id of its parent (``parents``,
  uint32), which is always an earlier id: a node of this frame, of an earlier frame of the same
  tree, or 0, the tree's root (the context before position ``start_pos``, whose next token is the
  first node's). Within one frame no node lies more than ``MAX_DEPTH`` below a node outside it.
  The tail answers every tree FORWARD with a VERDICT. Every FORWARD names its ``tree``: a frame of
  an older tree than the tail's newest is dropped unread. ``hidden`` holds the head slice's
  output for the frame's tokens as raw bytes (``dtype`` code, row-major ``n_tokens x
  hidden_size``); the sampling parameters travel with every frame, so each is self-contained:
  temperature, top-k, top-p, seed and repetition penalty (``params.REPETITION_PENALTY``'s range;
  1.0: off).
* VERDICT (tail -> head): for the tree FORWARD of the same ``round``: the frame's nodes that the
  target's walk committed (``path``, uint16 indices into the frame, ascending, at most
  ``MAX_DEPTH``; empty when no node of the frame was on the committed path) and the target's pick
  at each of them (``tokens``: the token after it); ``tail_us`` is the tail's compute time, used
  by the head to separate RTT from work.

This module is torch-free: tensors cross it as ``bytes`` plus a dtype code and a shape.
Every length is checked before anything is sliced, and any malformed input raises
``WireError`` (and nothing else; ``TreeError``, a ``WireError``, for a malformed tree or path),
so a hostile peer cannot crash the process. Version 2 added trees, version 3 epochs and assumed
outcomes; version 4 replaced chains, trees and epochs by one speculation tree across frames;
version 5 added the repetition penalty to a FORWARD's sampling parameters (a peer of another
version is refused by the first frame it sends, naming both versions).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field

from sfchat.params import REPETITION_PENALTY  # the range every source of a repetition penalty is held to

MAGIC = b"SFCH"
PROTOCOL_VERSION = 5

HEADER = struct.Struct("<4sBBHII")
FORWARD_FIXED = struct.Struct("<IIIIBIdIdQd")
# tree, start, n_tok, first_id, dtype, hidden, temp, top_k, top_p, seed, repetition penalty
# temperature, top_p and the penalty travel as doubles: the tail must cut exactly where generate() would
VERDICT_FIXED = struct.Struct("<III")  # tree, n (path length), tail_us

FLAG_VERDICT = 0x1  # FORWARD: the nodes of a speculation tree, to be verified (answered with a VERDICT)

MAX_JSON_BYTES = 1 << 16
MAX_TOKENS_PER_FRAME = 1 << 12
MAX_HIDDEN_SIZE = 1 << 15
MAX_DEPTH = 64  # the deepest a tree FORWARD's nodes reach below nodes outside it; a verdict's path
MAX_NODES = 256  # nodes of a tree FORWARD
MAX_SCRATCH = 1 << 13  # KV slots past the model's context a head may ask a tail for (its live nodes)


class WireError(ValueError):
    """A frame that does not follow this protocol (the connection should be closed)."""


class TreeError(WireError):
    """A tree FORWARD whose nodes, or a VERDICT whose path, is malformed."""


class MsgType(enum.IntEnum):
    HELLO = 1
    READY = 2
    PROGRESS = 3
    FORWARD = 4
    VERDICT = 5
    ERROR = 6
    BYE = 7


class DType(enum.IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2


JSON_TYPES = {MsgType.HELLO, MsgType.READY, MsgType.PROGRESS, MsgType.ERROR, MsgType.BYE}


@dataclass(frozen=True)
class Control:
    """A metadata frame (HELLO, READY, PROGRESS, ERROR, BYE) carrying a JSON object."""

    type: MsgType
    data: dict = field(default_factory=dict)
    round: int = 0


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of a request; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0  # generate()'s: tokens already in the context made less likely


@dataclass(frozen=True)
class Forward:
    """Head-slice output: a prefill run of positions, or nodes of a speculation tree to verify."""

    round: int  # the frame's number (its verdict names it)
    tree: int  # the speculation tree it belongs to
    start_pos: int  # prefill: the first position; tree frame: the position of the tree's first node
    tokens: tuple[int, ...]
    hidden: bytes
    dtype: DType
    hidden_size: int
    parents: tuple[int, ...] | None = None  # a tree frame: each node's parent id; None: prefill
    first_id: int = 0  # a tree frame: the id of its first node
    sampling: Sampling = Sampling()

    @property
    def verify(self) -> bool:
        return self.parents is not None


@dataclass(frozen=True)
class Verdict:
    """The tail's answer to a tree FORWARD."""

    round: int
    tree: int
    path: tuple[int, ...]  # indices in the frame of the nodes newly committed, ascending
    tokens: tuple[int, ...]  # the target's pick at each of them
    tail_us: int = 0


Message = Control | Forward | Verdict


def to_json(data) -> bytes:
    """``data`` as compact strict JSON; TypeError or ValueError for what JSON cannot hold (NaN too)."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


def from_json(raw: bytes):
    """Strict JSON back; ValueError for bad UTF-8, bad JSON, NaN, Infinity or a number past a
    double, RecursionError for nesting too deep."""
    return json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:20]} overflows a double")
    return value


def _pack(fmt: str, values, what: str) -> bytes:
    try:
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except struct.error as exc:
        raise WireError(f"{what}: {exc}") from None


def frame_depths(parents, first_id: int) -> list[int]:
    """Each node's depth below the nearest node outside the frame (1 for a node whose parent is
    outside it); TreeError for a parent that is not an earlier id or a depth past MAX_DEPTH."""
    depths = []
    for i, parent in enumerate(parents):
        if not 0 <= parent < first_id + i:
            raise TreeError(f"tree node {first_id + i} names parent {parent}: a parent must come before its node")
        depth = depths[parent - first_id] + 1 if parent >= first_id else 1
        if depth > MAX_DEPTH:
            raise TreeError(f"tree node {first_id + i} lies {depth} below the frame's outside, deeper than {MAX_DEPTH}")
        depths.append(depth)
    return depths


def _check_path(path, n_tokens: int) -> None:
    if len(path) != n_tokens or len(path) > MAX_DEPTH or any(not a < b for a, b in zip(path, path[1:])):
        raise TreeError(f"VERDICT path {list(path)[:8]} is not at most {MAX_DEPTH} ascending indices, one per token")


def encode(msg: Message) -> bytes:
    """Serialise one message into a frame; refuse (WireError) anything ``decode`` would refuse."""
    try:
        return _encode(msg)
    except (struct.error, OverflowError) as exc:  # a field that does not fit its wire slot
        raise WireError(f"cannot encode {type(msg).__name__}: {exc}") from None


def _encode(msg: Message) -> bytes:
    if isinstance(msg, Control):
        if msg.type not in JSON_TYPES:
            raise WireError(f"{getattr(msg.type, 'name', msg.type)} is not a JSON message type")
        if not isinstance(msg.data, dict):
            raise WireError(f"{msg.type.name} data must be a JSON object")
        try:
            body = to_json(msg.data)
        except (TypeError, ValueError) as exc:
            raise WireError(f"{msg.type.name} data is not JSON: {exc}") from None
        if len(body) > MAX_JSON_BYTES:
            raise WireError(f"{msg.type.name} body of {len(body)} bytes exceeds {MAX_JSON_BYTES}")
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg.type, 0, msg.round, len(body)) + body
    if isinstance(msg, Forward):
        _check_forward(len(msg.tokens), msg.hidden_size, msg.verify, msg.first_id)
        want = len(msg.tokens) * msg.hidden_size * msg.dtype.itemsize
        if len(msg.hidden) != want:
            raise WireError(f"hidden payload is {len(msg.hidden)} bytes, expected {want}")
        if msg.verify:
            if len(msg.parents) != len(msg.tokens):
                raise TreeError(f"a tree frame of {len(msg.tokens)} nodes with {len(msg.parents)} parents")
            frame_depths(msg.parents, msg.first_id)
        s = msg.sampling
        fixed = FORWARD_FIXED.pack(msg.tree, msg.start_pos, len(msg.tokens), msg.first_id, msg.dtype,
                                   msg.hidden_size, s.temperature, s.top_k, s.top_p, s.seed, s.repetition_penalty)
        _, _, _, _, _, _, temp, _, top_p, _, penalty = FORWARD_FIXED.unpack(fixed)  # as the peer will read them
        _check_sampling(temp, top_p, penalty)
        parents = _pack("I", msg.parents, "parents") if msg.verify else b""
        body = b"".join((fixed, _pack("i", msg.tokens, "tokens"), parents, msg.hidden))
        flags = FLAG_VERDICT if msg.verify else 0
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.FORWARD, flags, msg.round, len(body)) + body
    if isinstance(msg, Verdict):
        _check_path(msg.path, len(msg.tokens))
        fixed = VERDICT_FIXED.pack(msg.tree, len(msg.path), msg.tail_us)
        body = fixed + _pack("H", msg.path, "path") + _pack("i", msg.tokens, "tokens")
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.VERDICT, 0, msg.round, len(body)) + body
    raise WireError(f"cannot encode {type(msg).__name__}")


def max_frame_size(hidden_size: int, n_tokens: int = MAX_TOKENS_PER_FRAME) -> int:
    """Largest legal FORWARD frame for a model of ``hidden_size`` (used for websocket max_size)."""
    return HEADER.size + FORWARD_FIXED.size + 8 * n_tokens + 4 * n_tokens * hidden_size + MAX_JSON_BYTES


def _check_forward(n_tokens: int, hidden_size: int, tree: bool, first_id: int) -> None:
    if not 1 <= n_tokens <= (MAX_NODES if tree else MAX_TOKENS_PER_FRAME):
        raise WireError(f"FORWARD with {n_tokens} {'nodes' if tree else 'tokens'} "
                        f"(1..{MAX_NODES if tree else MAX_TOKENS_PER_FRAME} allowed)")
    if tree and not 1 <= first_id <= (1 << 32) - 1 - n_tokens:
        raise TreeError(f"a tree frame whose first node id is {first_id}")
    if not tree and first_id:
        raise WireError("a prefill FORWARD with node ids")
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise WireError(f"FORWARD hidden size {hidden_size} out of range")


def _check_sampling(temperature: float, top_p: float, penalty: float) -> None:
    if not (0.0 <= temperature < float("inf") and 0.0 < top_p <= 1.0):  # also refuses NaN
        raise WireError("FORWARD sampling parameters out of range")
    lo, hi = REPETITION_PENALTY
    if not lo <= penalty <= hi:
        raise WireError(f"FORWARD repetition penalty {penalty!r} is not between {lo:g} and {hi:g}")


def decode(frame: bytes) -> Message:
    """Parse one frame; raise ``WireError`` for anything that is not a valid frame."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError(f"expected a binary frame, got {type(frame).__name__}")
    frame = bytes(frame)
    if len(frame) < HEADER.size:
        raise WireError(f"frame of {len(frame)} bytes is shorter than the header")
    magic, version, mtype, flags, rnd, body_len = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise WireError("not an sfchat frame (bad magic)")
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})")
    if body_len != len(frame) - HEADER.size:
        raise WireError(f"header announces {body_len} body bytes, frame has {len(frame) - HEADER.size}")
    try:
        mtype = MsgType(mtype)
    except ValueError:
        raise WireError(f"unknown message type {mtype}") from None
    body = memoryview(frame)[HEADER.size:]
    if mtype in JSON_TYPES:
        return _decode_control(mtype, rnd, body)
    if mtype is MsgType.FORWARD:
        return _decode_forward(flags, rnd, body)
    return _decode_verdict(rnd, body)


def _decode_control(mtype: MsgType, rnd: int, body: memoryview) -> Control:
    if len(body) > MAX_JSON_BYTES:
        raise WireError(f"{mtype.name} body too large")
    try:
        data = from_json(bytes(body))
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON, too many digits
        raise WireError(f"{mtype.name} body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(f"{mtype.name} body must be a JSON object")
    return Control(mtype, data, rnd)


def _decode_forward(flags: int, rnd: int, body: memoryview) -> Forward:
    if len(body) < FORWARD_FIXED.size:
        raise WireError("FORWARD body too short")
    tree_id, start, n_tok, first_id, dt, hsize, temp, top_k, top_p, seed, penalty = FORWARD_FIXED.unpack_from(body)
    tree = bool(flags & FLAG_VERDICT)
    _check_forward(n_tok, hsize, tree, first_id)
    try:
        dtype = DType(dt)
    except ValueError:
        raise WireError(f"unknown hidden dtype code {dt}") from None
    sizes = (4 * n_tok, 4 * n_tok if tree else 0, n_tok * hsize * dtype.itemsize)
    if FORWARD_FIXED.size + sum(sizes) != len(body):
        raise WireError("FORWARD body length does not match its header")
    _check_sampling(temp, top_p, penalty)
    off, parts = FORWARD_FIXED.size, []
    for size in sizes:
        parts.append(bytes(body[off:off + size]))
        off += size
    parents = struct.unpack(f"<{n_tok}I", parts[1]) if tree else None
    if tree:
        frame_depths(parents, first_id)
    return Forward(round=rnd, tree=tree_id, start_pos=start, tokens=struct.unpack(f"<{n_tok}i", parts[0]),
                   hidden=parts[2], dtype=dtype, hidden_size=hsize, parents=parents, first_id=first_id,
                   sampling=Sampling(temp, top_k, top_p, seed, penalty))


def _decode_verdict(rnd: int, body: memoryview) -> Verdict:
    if len(body) < VERDICT_FIXED.size:
        raise WireError("VERDICT body too short")
    tree_id, n, tail_us = VERDICT_FIXED.unpack_from(body)
    if n > MAX_DEPTH:
        raise TreeError(f"a VERDICT path of {n} nodes (at most {MAX_DEPTH})")
    if VERDICT_FIXED.size + 6 * n != len(body):
        raise WireError("VERDICT body length does not match its header")
    off = VERDICT_FIXED.size + 2 * n
    path = struct.unpack(f"<{n}H", bytes(body[VERDICT_FIXED.size:off]))
    tokens = struct.unpack(f"<{n}i", bytes(body[off:]))
    _check_path(path, n)
    return Verdict(rnd, tree_id, path, tokens, tail_us)
