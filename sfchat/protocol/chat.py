"""Chat over the relay: what the chat screen on a person's own machine and the head it drives say.

Contract
--------
A *chat client* (``sfchat --remote``: the chat screen, no model) drives a *chat host* (a head that
runs elsewhere, ``sfchat --offer-chat``) through the relay, sealed end to end by
``sfchat.link.secure`` exactly as head and tail are. This module is their language: typed,
versioned, bounded messages, each checked field by field on arrival (``decode``), like HELLO and
READY. Every frame is::

    magic   4s  b"SFCT"
    version B   CHAT_VERSION
    type    B   ChatType
    body    I   body length in bytes (at most MAX_BODY_BYTES)
    body        a strict JSON object (no NaN, Infinity or numbers past a double), its fields per type

Client -> host: ``Attach`` (once per pairing, first), then ``Submit`` / ``Cancel`` / ``NewChat``
/ ``GiveCode`` (each with the client's next ``seq``), and ``Ack``. Host -> client: ``Welcome``
(the answer to ``Attach``), then ``Update`` (one runtime event of ``sfchat.events`` with the
host's next ``seq`` and the client's ``request`` it belongs to, 0 for none), and ``Ack``.
Sequenced messages are numbered 1, 2, 3 ... by their sender; a receiver takes only the number
after the last it took and drops every other, and the sender sends again, after a reconnect,
what the other side has not acknowledged (``Welcome.taken``, ``Attach.seen``, ``Ack``): so a
reconnect of either side loses and repeats nothing (``sfchat.remote``). Once attached, each side
sends an ``Ack`` (its last number again) at least every ``KEEPALIVE_S``, and a side that hears
nothing for ``SILENCE_S`` takes the link as stalled (a relay holding frames back, a pairing the
other side ended): the client dials again and resumes, the host ends that pairing.

An ``Update`` carries the event's own fields, and nothing of what the client has already:
a ``TokensCommitted`` its text, token ids and round figures; a ``ReplyFinished`` its figures
and the count of its tokens, its text only where that is not the streamed text (``text``: None
otherwise), so a finished reply never travels twice. ``update_event`` and ``finished_event``
rebuild the events. Texts are bounded (cut to their bound by the encoder where a longer one
would be refused) and kept as sent: whoever shows one to a person passes it through
``plaintext.plain`` (or ``reply_text`` for a reply's text, which keeps its line breaks) first.
``decode`` raises ``ChatError`` (a ``wire.WireError``) for anything else, never another
exception. Torch-free; imports nothing of sfchat but the wire's error, the events and
``plaintext``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import struct
from dataclasses import dataclass

from sfchat.events import (
    CodeWanted, LinkState, LoadProgress, ReplyFinished, ReplyStarted, RoundStats, RuntimeFailed, RuntimeReady,
    TokensCommitted,
)
from sfchat.protocol.wire import REPETITION_PENALTY, WireError

MAGIC = b"SFCT"
CHAT_VERSION = 1
HEADER = struct.Struct("<4sBBI")
MAX_BODY_BYTES = 6 << 20  # a conversation of MAX_CONVERSATION_CHARS, every character escaped, fits
MAX_SEQ = (1 << 53) - 1  # JSON numbers stay exact below this
MAX_REQUEST = MAX_SEQ
MAX_NAME = 512  # model ids, devices, dtypes
MAX_TEXT = 2000  # details, reasons, failure messages (what ``plain`` shows at most)
MAX_CODE = 256
MAX_CHUNK_CHARS = 1 << 16  # the text of one round's tokens
MAX_CHUNK_TOKENS = 1 << 12
MAX_REPLY_CHARS = 1 << 19  # a finished reply's text, when it travels at all
MAX_MESSAGES = 4096  # turns of a conversation
MAX_CONVERSATION_CHARS = 1 << 20
MAX_HISTOGRAM = 1 << 10
MAX_SHAPES = 16
MAX_MS = 1e9  # figures in milliseconds (11 days), seconds below, tok/s, bytes: all finite and bounded
MAX_COUNT = (1 << 53) - 1
ROLES = ("system", "user", "assistant")
LINK_STATES = ("local", "waiting", "connected", "stalled", "reconnecting", "closed")
NODES = ("head", "tail", "draft")
FINISH_REASONS = ("eos", "length", "context", "cancelled")
MODES = ("local", "relay")
CLIENT_ID = re.compile(r"[0-9a-f]{32}")
KEEPALIVE_S = 5.0  # an attached side sends at least this often
SILENCE_S = 20.0  # an attached side that hears nothing for this long takes the link as stalled


class ChatError(WireError):
    """A chat frame that does not follow this protocol."""


class ChatType(enum.IntEnum):
    ATTACH = 1
    WELCOME = 2
    SUBMIT = 3
    CANCEL = 4
    NEW_CHAT = 5
    GIVE_CODE = 6
    UPDATE = 7
    ACK = 8


# -- field checks ----------------------------------------------------------------------------------
def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _get(data: dict, key: str):
    if key not in data:
        raise ChatError(f"no {key!r}")
    return data[key]


def text(data: dict, key: str, most: int, empty: bool = True, choices: tuple[str, ...] = ()) -> str:
    value = _get(data, key)
    if type(value) is not str:
        raise ChatError(f"{key}={shown(value)} is not a string")
    if len(value) > most or (not empty and not value):
        raise ChatError(f"{key} of {len(value)} characters (1..{most})" if not empty else
                        f"{key} of {len(value)} characters (at most {most})")
    if choices and value not in choices:
        raise ChatError(f"{key}={shown(value)} is none of {', '.join(choices)}")
    return value


def integer(data: dict, key: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    value = _get(data, key)
    if type(value) is not int or not lo <= value <= hi:
        raise ChatError(f"{key}={shown(value)} is not a whole number in {lo}..{hi}")
    return value


def number(data: dict, key: str, lo: float = 0.0, hi: float = MAX_MS) -> float:
    value = _get(data, key)
    if type(value) not in (int, float) or not lo <= value <= hi:  # also refuses NaN
        raise ChatError(f"{key}={shown(value)} is not a number in {lo:g}..{hi:g}")
    return float(value)


def flag(data: dict, key: str) -> bool:
    value = _get(data, key)
    if type(value) is not bool:
        raise ChatError(f"{key}={shown(value)} is not true or false")
    return value


def array(data: dict, key: str, most: int) -> list:
    value = _get(data, key)
    if type(value) is not list or len(value) > most:
        raise ChatError(f"{key} is not a list of at most {most} items")
    return value


def ints(data: dict, key: str, most: int, hi: int = (1 << 31) - 1) -> tuple[int, ...]:
    items = array(data, key, most)
    if any(type(i) is not int or not 0 <= i <= hi for i in items):
        raise ChatError(f"{key} holds something other than whole numbers in 0..{hi}")
    return tuple(items)


def cut(value: str, most: int) -> str:
    return value if len(value) <= most else value[:most]


# -- client -> host --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Attach:
    """The client's first message on every pairing: who it is and what it holds of this host."""

    client: str  # 32 hex digits, drawn once per client process
    host: str  # the host instance it last heard from ("" before any)
    seen: int  # the last host seq it took from that instance

    def body(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, d: dict) -> "Attach":
        client, host = text(d, "client", 32), text(d, "host", 32)
        if not CLIENT_ID.fullmatch(client) or (host and not CLIENT_ID.fullmatch(host)):
            raise ChatError("client and host ids are 32 hex digits")
        return cls(client, host, integer(d, "seen", hi=MAX_SEQ))


@dataclass(frozen=True)
class Params:
    """Generation parameters of a request, in the ranges ``sfchat.config`` allows; a sampling
    setting None is the head's to choose (its flags, else the model's own default)."""

    max_new_tokens: int = 1024
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, d) -> "Params":
        if type(d) is not dict:
            raise ChatError("params is not an object")
        seed = d.get("seed")
        if seed is not None and (type(seed) is not int or not -(1 << 63) <= seed < (1 << 64)):
            raise ChatError(f"seed={shown(seed)} is not a whole number of at most 64 bits")
        top_p = None if d.get("top_p") is None else number(d, "top_p", 0.0, 1.0)
        if top_p is not None and top_p <= 0:
            raise ChatError("top_p must be above 0")
        temperature = None if d.get("temperature") is None else number(d, "temperature", 0.0, 2.0)
        top_k = None if d.get("top_k") is None else integer(d, "top_k", 0, 1 << 20)
        penalty = None if d.get("repetition_penalty") is None else number(d, "repetition_penalty", *REPETITION_PENALTY)
        return cls(integer(d, "max_new_tokens", 1, 1 << 20), temperature, top_k, top_p, seed, penalty)

    @classmethod
    def of(cls, params: dict) -> "Params":
        """The UI's params dict (missing keys: the defaults), checked as a peer's would be."""
        base = cls().as_dict() | {k: v for k, v in params.items() if k in cls.__dataclass_fields__}
        return cls.parse(base)


@dataclass(frozen=True)
class Submit:
    seq: int
    request: int  # the client's number for this reply (1, 2, 3 ...)
    messages: tuple[tuple[str, str], ...]  # (role, content): the whole conversation
    params: Params

    def body(self) -> dict:
        return {"seq": self.seq, "request": self.request, "params": self.params.as_dict(),
                "messages": [{"role": r, "content": c} for r, c in self.messages]}

    @classmethod
    def parse(cls, d: dict) -> "Submit":
        turns, total = [], 0
        for m in array(d, "messages", MAX_MESSAGES):
            if type(m) is not dict or set(m) != {"role", "content"}:
                raise ChatError("a message is an object of role and content")
            role, content = text(m, "role", 16, choices=ROLES), text(m, "content", MAX_CONVERSATION_CHARS)
            total += len(content)
            turns.append((role, content))
        if total > MAX_CONVERSATION_CHARS or not turns:
            raise ChatError(f"a conversation of 1..{MAX_MESSAGES} messages, {MAX_CONVERSATION_CHARS} characters")
        return cls(integer(d, "seq", 1, MAX_SEQ), integer(d, "request", 1, MAX_REQUEST), tuple(turns),
                   Params.parse(_get(d, "params")))


@dataclass(frozen=True)
class Cancel:
    seq: int
    request: int

    def body(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, d: dict) -> "Cancel":
        return cls(integer(d, "seq", 1, MAX_SEQ), integer(d, "request", 1, MAX_REQUEST))


@dataclass(frozen=True)
class NewChat:
    seq: int

    def body(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, d: dict) -> "NewChat":
        return cls(integer(d, "seq", 1, MAX_SEQ))


@dataclass(frozen=True)
class GiveCode:
    """The tail's pairing code, typed at the client when the host's runtime asked for it."""

    seq: int
    code: str

    def body(self) -> dict:
        return {"seq": self.seq, "code": cut(self.code, MAX_CODE)}

    @classmethod
    def parse(cls, d: dict) -> "GiveCode":
        return cls(integer(d, "seq", 1, MAX_SEQ), text(d, "code", MAX_CODE))


@dataclass(frozen=True)
class Ack:
    """Either way: every sequenced message up to ``seen`` arrived (the sender may forget them)."""

    seen: int

    def body(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, d: dict) -> "Ack":
        return cls(integer(d, "seen", hi=MAX_SEQ))


# -- host -> client --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Welcome:
    host: str  # this host instance (a restarted host has another)
    resumed: bool  # the client's earlier attachment goes on: what follows continues its updates
    base: int  # the seq of the update before the first one that follows
    taken: int  # the last client seq the host took (the client sends again what came after)

    def body(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, d: dict) -> "Welcome":
        host = text(d, "host", 32)
        if not CLIENT_ID.fullmatch(host):
            raise ChatError("a host id is 32 hex digits")
        return cls(host, flag(d, "resumed"), integer(d, "base", hi=MAX_SEQ), integer(d, "taken", hi=MAX_SEQ))


# the bound of each field of RoundStats (its type says which check: bool, int or float); a field
# that RoundStats gains and this table lacks stops the import, so no figure is dropped on the way
STATS_BOUNDS = {"accepted": MAX_CHUNK_TOKENS, "committed": MAX_CHUNK_TOKENS, "draft_ms": MAX_MS, "head_ms": MAX_MS,
                "tail_ms": MAX_MS, "rtt_ms": MAX_MS, "round_ms": MAX_MS, "wait_ms": MAX_MS, "overlap_ms": MAX_MS,
                "speculated": None, "forward_bytes": MAX_COUNT, "tree_nodes": MAX_CHUNK_TOKENS,
                "depth": MAX_CHUNK_TOKENS, "in_flight": MAX_CHUNK_TOKENS, "draft_steps": MAX_COUNT,
                "expected": MAX_CHUNK_TOKENS, "ahead_steps": MAX_COUNT}
if set(STATS_BOUNDS) != {f.name for f in dataclasses.fields(RoundStats)}:
    raise ImportError("chat.STATS_BOUNDS and events.RoundStats name different fields")


def _stats(d) -> RoundStats:
    if type(d) is not dict:
        raise ChatError("stats is not an object")
    values = {}
    for f in dataclasses.fields(RoundStats):
        kind, hi = getattr(f.type, "__name__", f.type), STATS_BOUNDS[f.name]  # a type, or its name
        values[f.name] = (flag(d, f.name) if kind == "bool" else integer(d, f.name, hi=hi) if kind == "int"
                          else number(d, f.name, hi=hi))
    return RoundStats(**values)


FIGURES = ("tps", "ttft_s", "prefill_s", "round_ms", "rtt_ms", "draft_ms", "head_ms", "tail_ms", "wait_ms",
           "overlap_ms", "in_flight_mean", "depth_mean", "forward_bytes", "tokens_per_round", "hit_rate")


@dataclass(frozen=True)
class Finished:
    """A ``ReplyFinished`` without what the client already has (see ``finished_event``)."""

    finish_reason: str
    text: str | None  # None: the reply's text is the text streamed before it
    tokens: int  # tokens of the reply
    prompt_tokens: int
    rounds: int
    accepted_histogram: tuple[int, ...]
    tree_budget: int
    figures: dict  # FIGURES -> float

    @classmethod
    def of(cls, event: ReplyFinished, streamed: str) -> "Finished":
        own = None if event.text == streamed or len(event.text) > MAX_REPLY_CHARS else event.text
        return cls(event.finish_reason, own, len(event.token_ids), event.prompt_tokens, event.rounds,
                   tuple(event.accepted_histogram), event.tree_budget, {k: getattr(event, k) for k in FIGURES})

    @classmethod
    def parse(cls, d: dict) -> "Finished":
        own = d.get("text")
        if own is not None:
            own = text(d, "text", MAX_REPLY_CHARS)
        figures = {k: number(d, k, 0.0, MAX_MS) for k in FIGURES}
        return cls(text(d, "finish_reason", 16, choices=FINISH_REASONS), own, integer(d, "tokens"),
                   integer(d, "prompt_tokens"), integer(d, "rounds"),
                   ints(d, "accepted_histogram", MAX_HISTOGRAM, MAX_COUNT), integer(d, "tree_budget", hi=1 << 20),
                   figures)

    def body(self) -> dict:
        return {"finish_reason": self.finish_reason, "text": self.text, "tokens": self.tokens,
                "prompt_tokens": self.prompt_tokens, "rounds": self.rounds,
                "accepted_histogram": list(self.accepted_histogram), "tree_budget": self.tree_budget, **self.figures}


def finished_event(f: Finished, streamed: str, token_ids: tuple[int, ...]) -> ReplyFinished:
    """The head's ``ReplyFinished`` again, from its figures and what the client streamed."""
    return ReplyFinished(f.finish_reason, streamed if f.text is None else f.text, token_ids, f.prompt_tokens,
                         f.rounds, accepted_histogram=f.accepted_histogram, tree_budget=f.tree_budget,
                         **f.figures)


def _event_body(event) -> tuple[str, dict]:
    """An event's kind and fields for the wire, every text cut to its bound."""
    match event:
        case LoadProgress():
            return "progress", {"node": event.node, "stage": cut(event.stage, 64), "done": event.done,
                                "total": event.total, "detail": cut(event.detail, MAX_TEXT)}
        case RuntimeReady():
            d = dataclasses.asdict(event)
            for key in ("model", "draft", "dtype", "device", "quant", "tail_dtype"):
                d[key] = cut(d[key], MAX_NAME)
            d["shapes"] = [cut(s, 64) for s in event.shapes[:MAX_SHAPES]]
            return "ready", d
        case LinkState():
            return "link", {"state": event.state, "detail": cut(event.detail, MAX_TEXT)}
        case ReplyStarted():
            return "started", dataclasses.asdict(event)
        case TokensCommitted():
            return "tokens", {"text": cut(event.text, MAX_CHUNK_CHARS), "token_ids": list(event.token_ids),
                              "stats": dataclasses.asdict(event.stats), "elapsed_s": event.elapsed_s}
        case Finished():
            return "finished", event.body()
        case CodeWanted():
            return "code_wanted", {"reason": cut(event.reason, MAX_TEXT)}
        case RuntimeFailed():
            return "failed", {"message": cut(event.message, MAX_TEXT), "fatal": event.fatal}
    raise ChatError(f"{type(event).__name__} does not travel to a chat client")


def _event(kind: str, d: dict):
    if kind == "progress":
        return LoadProgress(text(d, "node", 16, choices=NODES), text(d, "stage", 64, empty=False),
                            integer(d, "done"), integer(d, "total"), text(d, "detail", MAX_TEXT))
    if kind == "ready":
        shapes = array(d, "shapes", MAX_SHAPES)
        if any(type(s) is not str or len(s) > 64 for s in shapes):
            raise ChatError("shapes holds something other than short strings")
        return RuntimeReady(
            model=text(d, "model", MAX_NAME, empty=False), draft=text(d, "draft", MAX_NAME, empty=False),
            split=integer(d, "split", hi=1 << 12), n_layers=integer(d, "n_layers", hi=1 << 12),
            dtype=text(d, "dtype", MAX_NAME), k=integer(d, "k", hi=1 << 10), device=text(d, "device", MAX_NAME),
            mode=text(d, "mode", 8, choices=MODES), max_context=integer(d, "max_context", 1, 1 << 24),
            quant=text(d, "quant", MAX_NAME), tail_dtype=text(d, "tail_dtype", MAX_NAME),
            tree_budget=integer(d, "tree_budget", hi=1 << 20), shapes=tuple(shapes),
            max_in_flight=integer(d, "max_in_flight", hi=1 << 10))
    if kind == "link":
        return LinkState(text(d, "state", 16, choices=LINK_STATES), text(d, "detail", MAX_TEXT))
    if kind == "started":
        return ReplyStarted(integer(d, "prompt_tokens"), integer(d, "reused_tokens"), integer(d, "prefill_tokens"),
                            integer(d, "dropped_turns"))
    if kind == "tokens":
        return TokensCommitted(text(d, "text", MAX_CHUNK_CHARS), ints(d, "token_ids", MAX_CHUNK_TOKENS),
                               _stats(_get(d, "stats")), number(d, "elapsed_s"))
    if kind == "finished":
        return Finished.parse(d)
    if kind == "code_wanted":
        return CodeWanted(text(d, "reason", MAX_TEXT))
    if kind == "failed":
        return RuntimeFailed(text(d, "message", MAX_TEXT), flag(d, "fatal"))
    raise ChatError(f"an update of unknown kind {shown(kind)}")


@dataclass(frozen=True)
class Update:
    """One runtime event of the host, for the client's ``request`` (0: for no request)."""

    seq: int
    request: int
    event: object  # an sfchat.events event, a ``Finished`` in place of a ReplyFinished

    def body(self) -> dict:
        kind, fields = _event_body(self.event)
        return {"seq": self.seq, "request": self.request, "kind": kind, "event": fields}

    @classmethod
    def parse(cls, d: dict) -> "Update":
        fields = _get(d, "event")
        if type(fields) is not dict:
            raise ChatError("event is not an object")
        return cls(integer(d, "seq", 1, MAX_SEQ), integer(d, "request", hi=MAX_REQUEST),
                   _event(text(d, "kind", 16), fields))


CLASSES = {ChatType.ATTACH: Attach, ChatType.WELCOME: Welcome, ChatType.SUBMIT: Submit, ChatType.CANCEL: Cancel,
           ChatType.NEW_CHAT: NewChat, ChatType.GIVE_CODE: GiveCode, ChatType.UPDATE: Update, ChatType.ACK: Ack}
TYPES = {cls: kind for kind, cls in CLASSES.items()}
Message = Attach | Welcome | Submit | Cancel | NewChat | GiveCode | Update | Ack


# -- frames ----------------------------------------------------------------------------------------
def encode(msg: Message) -> bytes:
    """One message as a frame; ChatError for one that ``decode`` would refuse."""
    if type(msg) not in TYPES:
        raise ChatError(f"{type(msg).__name__} is no chat message")
    try:
        body = json.dumps(msg.body(), separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ChatError(f"{type(msg).__name__} is not JSON: {exc}") from None
    frame = HEADER.pack(MAGIC, CHAT_VERSION, TYPES[type(msg)], len(body)) + body
    decode(frame)  # what the peer would refuse is refused here, where the bug is
    return frame


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite(number_text: str) -> float:
    value = float(number_text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {number_text[:20]} overflows a double")
    return value


def decode(frame) -> Message:
    """One frame as its message; ChatError for anything that is not a valid chat frame."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ChatError(f"expected a binary frame, got {type(frame).__name__}")
    frame = bytes(frame)
    if len(frame) < HEADER.size:
        raise ChatError(f"a frame of {len(frame)} bytes is shorter than the header")
    magic, version, kind, length = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ChatError("not an sfchat chat frame (bad magic): is the other side a head offering its chat?")
    if version != CHAT_VERSION:
        raise ChatError(f"chat protocol version {version} is not supported (this side speaks {CHAT_VERSION}): "
                        "run the same sfchat version on both sides")
    if length != len(frame) - HEADER.size or length > MAX_BODY_BYTES:
        raise ChatError(f"a body of {len(frame) - HEADER.size} bytes announced as {length} "
                        f"(at most {MAX_BODY_BYTES})")
    try:
        cls = CLASSES[ChatType(kind)]
    except ValueError:
        raise ChatError(f"unknown chat message type {kind}") from None
    try:
        data = json.loads(frame[HEADER.size:].decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        raise ChatError(f"{cls.__name__} body is not JSON: {shown(str(exc))}") from None
    if type(data) is not dict:
        raise ChatError(f"{cls.__name__} body is not a JSON object")
    try:
        return cls.parse(data)
    except ChatError as exc:
        raise ChatError(f"{cls.__name__}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a check this module missed: still refused
        raise ChatError(f"{cls.__name__}: malformed ({type(exc).__name__})") from None


REPLY_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def reply_text(value: str) -> str:
    """A reply's text from a peer, safe to render: no escape sequence or control character, its
    line breaks and tabs kept (without ESC and C1 no terminal sequence can start)."""
    return REPLY_CONTROLS.sub("", value.replace("\r\n", "\n"))


def update_event(u: Update):
    """The event an update carries, with every one-line text made plain (``plaintext.plain``) and a
    reply's text freed of control characters; a ``Finished`` stays one (``finished_event``)."""
    from sfchat.plaintext import plain

    e = u.event
    match e:
        case LoadProgress():
            return dataclasses.replace(e, stage=plain(e.stage), detail=plain(e.detail))
        case RuntimeReady():
            return dataclasses.replace(e, model=plain(e.model), draft=plain(e.draft), dtype=plain(e.dtype),
                                       device=plain(e.device), quant=plain(e.quant), tail_dtype=plain(e.tail_dtype),
                                       shapes=tuple(plain(s) for s in e.shapes))
        case LinkState():
            return dataclasses.replace(e, detail=plain(e.detail))
        case TokensCommitted():
            return dataclasses.replace(e, text=reply_text(e.text))
        case Finished():
            return e if e.text is None else dataclasses.replace(e, text=reply_text(e.text))
        case CodeWanted():
            return CodeWanted(plain(e.reason))
        case RuntimeFailed():
            return dataclasses.replace(e, message=plain(e.message))
    return e
