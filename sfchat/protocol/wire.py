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
  that overflow a double (``1e999``) are refused, as RFC 8259 has no such values.
* FORWARD (head -> tail): a run of ``n_tokens`` consecutive positions starting at
  ``start_pos`` whose last ``n_draft`` tokens are draft proposals to verify. With FLAG_TREE
  the drafts form a token tree instead of a chain: the frame is ``[t0, node 1 .. node N]``
  (``n_tokens == n_draft + 1``) and ``parents`` (uint16, one per node) names each node's
  parent by its index in the frame (0 = t0), always an earlier one; a node's depth is its
  parent's plus one and at most ``MAX_DEPTH``. Tree frames carry no draft distributions. ``hidden`` holds
  the head slice's output for those positions as raw bytes (``dtype`` code, row-major
  ``n_tokens x hidden_size``). With FLAG_VERDICT the tail answers with a VERDICT; without it
  (prefill chunks) the tail only fills its KV cache. Optional sparse draft distributions
  (``n_q`` entries per drafted position) and the sampling parameters travel with the frame,
  so every round is self-contained. Every FORWARD names its ``epoch`` and what it ``assumes``:
  the committed tokens of the verdict just before it in the same epoch (empty: it assumes
  nothing, and a new epoch starts with such a frame). A frame sent before that verdict was known
  (speculation in flight) is verified only if the verdict is what it assumes; otherwise the tail
  drops it and every later frame of its epoch (see ``runtime/tail.py``).
* VERDICT (tail -> head): ``n_accepted`` drafts were accepted; ``tokens`` are the committed
  tokens of the round (the accepted drafts, then the target's own next token); ``path``
  (uint16, one per accepted draft) their indices in the FORWARD, ascending (``1..n`` for a chain);
  ``tail_us`` is the tail's compute time, used by the head to separate RTT from work.

This module is torch-free: tensors cross it as ``bytes`` plus a dtype code and a shape.
Every length is checked before anything is sliced, and any malformed input raises
``WireError`` (and nothing else; ``TreeError``, a ``WireError``, for a malformed tree or path),
so a hostile peer cannot crash the process. Version 2 added trees (FLAG_TREE, parents, path);
version 3 epochs and assumed outcomes (frames in flight).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field

MAGIC = b"SFCH"
PROTOCOL_VERSION = 3

HEADER = struct.Struct("<4sBBHII")
FORWARD_FIXED = struct.Struct("<IIIBIIdIdQIH")
# start, n_tok, n_draft, dtype, hidden, n_q, temp, top_k, top_p, seed, epoch, n_assumes
# temperature and top_p travel as doubles: the tail must cut exactly where generate() would
VERDICT_FIXED = struct.Struct("<IIII")  # start, n_accepted, n_tokens, tail_us

FLAG_VERDICT = 0x1  # FORWARD: answer with a VERDICT
FLAG_TREE = 0x2  # FORWARD: the drafts form a tree (``parents`` follows the tokens)

MAX_JSON_BYTES = 1 << 16
MAX_TOKENS_PER_FRAME = 1 << 12
MAX_HIDDEN_SIZE = 1 << 15
MAX_DRAFT = 64  # drafts of a chain; also the deepest a tree may reach (MAX_DEPTH)
MAX_DEPTH = MAX_DRAFT
MAX_NODES = 256  # drafts of a tree
MAX_Q_ENTRIES = 1 << 12
MAX_ASSUMED = MAX_DEPTH + 1  # a verdict's tokens: every draft of the deepest path, and one more


class WireError(ValueError):
    """A frame that does not follow this protocol (the connection should be closed)."""


class TreeError(WireError):
    """A FORWARD whose token tree, or a VERDICT whose accepted path, is malformed."""


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

    @classmethod
    def from_name(cls, name: str) -> "DType":
        try:
            return {"float32": cls.FLOAT32, "float16": cls.FLOAT16, "bfloat16": cls.BFLOAT16}[name]
        except KeyError:
            raise WireError(f"unsupported dtype {name!r}") from None


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


@dataclass(frozen=True)
class Forward:
    """Head-slice output for consecutive positions, optionally to be verified."""

    round: int
    start_pos: int
    tokens: tuple[int, ...]
    hidden: bytes
    dtype: DType
    hidden_size: int
    n_draft: int = 0
    want_verdict: bool = True
    sampling: Sampling = Sampling()
    n_q: int = 0
    q_indices: bytes = b""  # int32, n_draft * n_q
    q_probs: bytes = b""  # float32, n_draft * n_q
    parents: tuple[int, ...] | None = None  # a tree: each node's parent (index in the frame); None: a chain
    epoch: int = 0
    assumes: tuple[int, ...] = ()  # the previous verdict's tokens this frame was built on; (): none


@dataclass(frozen=True)
class Verdict:
    """The tail's answer to a FORWARD with FLAG_VERDICT."""

    round: int
    start_pos: int
    n_accepted: int
    tokens: tuple[int, ...]
    tail_us: int = 0
    path: tuple[int, ...] | None = None  # the accepted drafts' indices in the FORWARD; None: 1..n_accepted

    def __post_init__(self) -> None:
        if self.path is None:
            n = self.n_accepted if isinstance(self.n_accepted, int) else 0
            object.__setattr__(self, "path", tuple(range(1, min(n, MAX_DRAFT + 1) + 1)))  # encode refuses more


Message = Control | Forward | Verdict


def _int32s(values, what: str) -> bytes:
    try:
        return struct.pack(f"<{len(values)}i", *values)
    except struct.error as exc:
        raise WireError(f"{what}: {exc}") from None


def _uint16s(values, what: str) -> bytes:
    try:
        return struct.pack(f"<{len(values)}H", *values)
    except struct.error as exc:
        raise WireError(f"{what}: {exc}") from None


def tree_depths(parents) -> list[int]:
    """The depth of each node of a tree frame (t0 has depth 0); TreeError for a malformed tree:
    a parent at or after its node, or a depth past MAX_DEPTH."""
    depths = [0]
    for i, parent in enumerate(parents, start=1):
        if not 0 <= parent < i:
            raise TreeError(f"tree node {i} names parent {parent}: a parent must come before its node")
        depth = depths[parent] + 1
        if depth > MAX_DEPTH:
            raise TreeError(f"tree node {i} at depth {depth}, deeper than {MAX_DEPTH}")
        depths.append(depth)
    return depths


def _check_path(path, n_accepted: int) -> None:
    if len(path) != n_accepted or any(not a < b for a, b in zip((0,) + tuple(path), path)):
        raise TreeError(f"VERDICT path {list(path)[:8]} is not {n_accepted} ascending node indices")


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
            body = json.dumps(msg.data, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise WireError(f"{msg.type.name} data is not JSON: {exc}") from None
        if len(body) > MAX_JSON_BYTES:
            raise WireError(f"{msg.type.name} body of {len(body)} bytes exceeds {MAX_JSON_BYTES}")
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg.type, 0, msg.round, len(body)) + body
    if isinstance(msg, Forward):
        tree = msg.parents is not None
        _check_forward(len(msg.tokens), msg.n_draft, msg.hidden_size, msg.n_q, tree, len(msg.assumes))
        _check_forward_sizes(msg)
        if tree:
            if len(msg.parents) != msg.n_draft:
                raise TreeError(f"a tree of {msg.n_draft} nodes with {len(msg.parents)} parents")
            tree_depths(msg.parents)
            if not msg.want_verdict:
                raise TreeError("a tree FORWARD must ask for a verdict")
        s = msg.sampling
        fixed = FORWARD_FIXED.pack(
            msg.start_pos, len(msg.tokens), msg.n_draft, msg.dtype, msg.hidden_size, msg.n_q,
            s.temperature, s.top_k, s.top_p, s.seed, msg.epoch, len(msg.assumes),
        )
        _, _, _, _, _, _, temp, _, top_p, _, _, _ = FORWARD_FIXED.unpack(fixed)  # as the peer will read them
        _check_sampling(temp, top_p)
        parents = _uint16s(msg.parents, "parents") if tree else b""
        body = b"".join((fixed, _int32s(msg.tokens, "tokens"), parents, _int32s(msg.assumes, "assumes"), msg.hidden,
                         msg.q_indices, msg.q_probs))
        flags = (FLAG_VERDICT if msg.want_verdict else 0) | (FLAG_TREE if tree else 0)
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.FORWARD, flags, msg.round, len(body)) + body
    if isinstance(msg, Verdict):
        _check_verdict(msg.n_accepted, len(msg.tokens))
        _check_path(msg.path, msg.n_accepted)
        fixed = VERDICT_FIXED.pack(msg.start_pos, msg.n_accepted, len(msg.tokens), msg.tail_us)
        body = fixed + _int32s(msg.tokens, "tokens") + _uint16s(msg.path, "path")
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.VERDICT, 0, msg.round, len(body)) + body
    raise WireError(f"cannot encode {type(msg).__name__}")


def max_frame_size(hidden_size: int, n_tokens: int = MAX_TOKENS_PER_FRAME, n_q: int = 0) -> int:
    """Largest legal FORWARD frame for a model of ``hidden_size`` (used for websocket max_size)."""
    return (HEADER.size + FORWARD_FIXED.size + 6 * n_tokens + 4 * MAX_ASSUMED + 4 * n_tokens * hidden_size
            + 8 * MAX_DRAFT * n_q + MAX_JSON_BYTES)


def _check_forward(n_tokens: int, n_draft: int, hidden_size: int, n_q: int, tree: bool = False,
                   n_assumes: int = 0) -> None:
    if not 0 <= n_assumes <= MAX_ASSUMED:
        raise WireError(f"FORWARD assuming {n_assumes} tokens (at most {MAX_ASSUMED})")
    if not 1 <= n_tokens <= MAX_TOKENS_PER_FRAME:
        raise WireError(f"FORWARD with {n_tokens} tokens (1..{MAX_TOKENS_PER_FRAME} allowed)")
    if tree:
        if not 1 <= n_draft <= MAX_NODES or n_tokens != n_draft + 1 or n_q:
            raise TreeError(f"a tree FORWARD with {n_draft} nodes, {n_tokens} tokens and {n_q} distribution "
                            f"entries (1..{MAX_NODES} nodes, one token more, no distributions)")
    elif not 0 <= n_draft <= min(n_tokens - 1, MAX_DRAFT):
        raise WireError(f"FORWARD with {n_draft} drafts for {n_tokens} tokens")
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise WireError(f"FORWARD hidden size {hidden_size} out of range")
    if not 0 <= n_q <= MAX_Q_ENTRIES:
        raise WireError(f"FORWARD with {n_q} distribution entries per draft")


def _check_sampling(temperature: float, top_p: float) -> None:
    if not (0.0 <= temperature < float("inf") and 0.0 < top_p <= 1.0):  # also refuses NaN
        raise WireError("FORWARD sampling parameters out of range")


def _check_verdict(n_accepted: int, n_tokens: int) -> None:
    if not 1 <= n_tokens <= MAX_DRAFT + 1 or n_accepted != n_tokens - 1:
        raise WireError(f"VERDICT with {n_accepted} accepted and {n_tokens} tokens")


def _check_forward_sizes(msg: Forward) -> None:
    want = len(msg.tokens) * msg.hidden_size * msg.dtype.itemsize
    if len(msg.hidden) != want:
        raise WireError(f"hidden payload is {len(msg.hidden)} bytes, expected {want}")
    nq = msg.n_draft * msg.n_q * 4
    if len(msg.q_indices) != nq or len(msg.q_probs) != nq:
        raise WireError("draft distribution payload does not match n_draft * n_q")


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
        data = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON, too many digits
        raise WireError(f"{mtype.name} body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(f"{mtype.name} body must be a JSON object")
    return Control(mtype, data, rnd)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:20]} overflows a double")
    return value


def _decode_forward(flags: int, rnd: int, body: memoryview) -> Forward:
    if len(body) < FORWARD_FIXED.size:
        raise WireError("FORWARD body too short")
    start, n_tok, n_draft, dt, hsize, n_q, temp, top_k, top_p, seed, epoch, n_assumes = FORWARD_FIXED.unpack_from(body)
    tree = bool(flags & FLAG_TREE)
    _check_forward(n_tok, n_draft, hsize, n_q, tree, n_assumes)
    try:
        dtype = DType(dt)
    except ValueError:
        raise WireError(f"unknown hidden dtype code {dt}") from None
    sizes = (4 * n_tok, 2 * n_draft if tree else 0, 4 * n_assumes, n_tok * hsize * dtype.itemsize,
             4 * n_draft * n_q, 4 * n_draft * n_q)
    if FORWARD_FIXED.size + sum(sizes) != len(body):
        raise WireError("FORWARD body length does not match its header")
    _check_sampling(temp, top_p)
    off = FORWARD_FIXED.size
    parts = []
    for size in sizes:
        parts.append(bytes(body[off:off + size]))
        off += size
    tokens = struct.unpack(f"<{n_tok}i", parts[0])
    parents = struct.unpack(f"<{n_draft}H", parts[1]) if tree else None
    if tree:
        tree_depths(parents)
        if not flags & FLAG_VERDICT:
            raise TreeError("a tree FORWARD must ask for a verdict")
    return Forward(
        round=rnd, start_pos=start, tokens=tokens, hidden=parts[3], dtype=dtype, hidden_size=hsize,
        n_draft=n_draft, want_verdict=bool(flags & FLAG_VERDICT),
        sampling=Sampling(temp, top_k, top_p, seed), n_q=n_q, q_indices=parts[4], q_probs=parts[5],
        parents=parents, epoch=epoch, assumes=struct.unpack(f"<{n_assumes}i", parts[2]),
    )


def _decode_verdict(rnd: int, body: memoryview) -> Verdict:
    if len(body) < VERDICT_FIXED.size:
        raise WireError("VERDICT body too short")
    start, n_acc, n_tok, tail_us = VERDICT_FIXED.unpack_from(body)
    _check_verdict(n_acc, n_tok)
    if VERDICT_FIXED.size + 4 * n_tok + 2 * n_acc != len(body):
        raise WireError("VERDICT body length does not match its header")
    off = VERDICT_FIXED.size + 4 * n_tok
    tokens = struct.unpack(f"<{n_tok}i", bytes(body[VERDICT_FIXED.size:off]))
    path = struct.unpack(f"<{n_acc}H", bytes(body[off:]))
    _check_path(path, n_acc)
    return Verdict(rnd, start, n_acc, tokens, tail_us, path)
