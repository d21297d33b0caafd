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

Most messages are ``Tabled``: their ``BOUNDS`` (one ``chat_events`` bound per field, checked
against the dataclass's fields at import) say how each field is sent and checked; ``Submit``
and ``Update`` check theirs by hand. A ``Submit``'s parameters are a ``params.Ask`` (the reply's
token limit and its ``params.GenParams``), sent as one flat object (``params_body``) and checked
within ``params.BOUNDS`` (``parse_params``). An ``Update`` carries one runtime event as
``protocol.chat_events`` writes it: the event's own fields, each within its bound, and nothing of
what the client has already (a finished reply travels as a ``chat_events.Finished``);
``chat_events.update_event`` makes what a person will see of it plain. ``encode`` refuses
(``ChatError``) what ``decode`` would refuse. ``decode`` raises ``ChatError`` (a
``wire.WireError``) for anything that is not one of these messages, never another exception: the
checks of ``protocol.fields`` and ``chat_events`` raise ``WireError``, which ``decode`` words as
a ``ChatError`` naming the message. Torch-free; imports nothing of sfchat but ``params``,
``fields``, ``chat_events`` and the wire's error and strict JSON.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass

from sfchat.params import BOUNDS, Ask, GenParams
from sfchat.protocol.chat_events import Bound, Flag, Text, Whole, event_body, event_of, fits, sent, taken
from sfchat.protocol.fields import MAX_EXACT, array, integer, number, required, shown, text
from sfchat.protocol.wire import WireError, from_json, to_json

MAGIC = b"SFCT"
CHAT_VERSION = 1
HEADER = struct.Struct("<4sBBI")
MAX_BODY_BYTES = 6 << 20  # a conversation of MAX_CONVERSATION_CHARS, every character escaped, fits
MAX_SEQ = MAX_EXACT
MAX_REQUEST = MAX_SEQ
MAX_CODE = 256
MAX_MESSAGES = 4096  # turns of a conversation
MAX_CONVERSATION_CHARS = 1 << 20
MAX_NEW_TOKENS = 1 << 20
ROLES = ("system", "user", "assistant")
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


# -- client -> host --------------------------------------------------------------------------------
class Tabled:
    """A message whose fields travel as its ``BOUNDS`` (field name -> a ``chat_events`` bound) say."""

    BOUNDS: dict

    def body(self) -> dict:
        return sent(self, self.BOUNDS)

    @classmethod
    def parse(cls, d: dict):
        return cls(**taken(cls.BOUNDS, d))


@dataclass(frozen=True)
class Id(Bound):
    """An instance id: 32 hex digits (the messages check which may be empty), sent as it is."""

    def take(self, data: dict, key: str) -> str:
        return text(data, key, 32)


@dataclass(frozen=True)
class Attach(Tabled):
    """The client's first message on every pairing: who it is and what it holds of this host."""

    client: str  # 32 hex digits, drawn once per client process
    host: str  # the host instance it last heard from ("" before any)
    seen: int  # the last host seq it took from that instance
    BOUNDS = {"client": Id(), "host": Id(), "seen": Whole(hi=MAX_SEQ)}

    @classmethod
    def parse(cls, d: dict) -> "Attach":
        msg = super().parse(d)
        if not CLIENT_ID.fullmatch(msg.client) or (msg.host and not CLIENT_ID.fullmatch(msg.host)):
            raise ChatError("client and host ids are 32 hex digits")
        return msg


def params_body(ask: Ask) -> dict:
    """A ``Submit``'s parameters as they travel: one flat object, a sampling value None for the head's."""
    gen = ask.gen
    return {"max_new_tokens": ask.max_new_tokens, "temperature": gen.temperature, "top_k": gen.top_k,
            "top_p": gen.top_p, "seed": gen.seed, "repetition_penalty": gen.repetition_penalty}


def parse_params(d) -> Ask:
    """A ``Submit``'s parameters, each within ``params.BOUNDS`` (None: the head's to choose)."""
    if type(d) is not dict:
        raise ChatError("params is not an object")

    def given(key: str, check):
        return None if d.get(key) is None else check(d, key, BOUNDS[key].lo, BOUNDS[key].hi)

    seed = d.get("seed")
    if seed is not None and not BOUNDS["seed"].fits(seed):
        raise ChatError(f"seed={shown(seed)} is not a whole number of at most 64 bits")
    top_p = given("top_p", number)
    if top_p is not None and top_p <= BOUNDS["top_p"].lo:
        raise ChatError("top_p must be above 0")
    gen = GenParams(temperature=given("temperature", number), top_k=given("top_k", integer), top_p=top_p,
                    repetition_penalty=given("repetition_penalty", number), seed=seed)
    return Ask(integer(d, "max_new_tokens", 1, MAX_NEW_TOKENS), gen)


@dataclass(frozen=True)
class Submit:
    seq: int
    request: int  # the client's number for this reply (1, 2, 3 ...)
    messages: tuple[tuple[str, str], ...]  # (role, content): the whole conversation
    params: Ask

    def body(self) -> dict:
        return {"seq": self.seq, "request": self.request, "params": params_body(self.params),
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
                   parse_params(required(d, "params")))


SEQ = Whole(1, MAX_SEQ)


@dataclass(frozen=True)
class Cancel(Tabled):
    seq: int
    request: int
    BOUNDS = {"seq": SEQ, "request": Whole(1, MAX_REQUEST)}


@dataclass(frozen=True)
class NewChat(Tabled):
    seq: int
    BOUNDS = {"seq": SEQ}


@dataclass(frozen=True)
class GiveCode(Tabled):
    """The tail's pairing code, typed at the client when the host's runtime asked for it."""

    seq: int
    code: str
    BOUNDS = {"seq": SEQ, "code": Text(MAX_CODE)}


@dataclass(frozen=True)
class Ack(Tabled):
    """Either way: every sequenced message up to ``seen`` arrived (the sender may forget them)."""

    seen: int
    BOUNDS = {"seen": Whole(hi=MAX_SEQ)}


# -- host -> client --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Welcome(Tabled):
    host: str  # this host instance (a restarted host has another)
    resumed: bool  # the client's earlier attachment goes on: what follows continues its updates
    base: int  # the seq of the update before the first one that follows
    taken: int  # the last client seq the host took (the client sends again what came after)
    BOUNDS = {"host": Id(), "resumed": Flag(), "base": Whole(hi=MAX_SEQ), "taken": Whole(hi=MAX_SEQ)}

    @classmethod
    def parse(cls, d: dict) -> "Welcome":
        msg = super().parse(d)
        if not CLIENT_ID.fullmatch(msg.host):
            raise ChatError("a host id is 32 hex digits")
        return msg


@dataclass(frozen=True)
class Update:
    """One runtime event of the host, for the client's ``request`` (0: for no request)."""

    seq: int
    request: int
    event: object  # an sfchat.events event, a ``Finished`` in place of a ReplyFinished

    def body(self) -> dict:
        kind, fields = event_body(self.event)
        return {"seq": self.seq, "request": self.request, "kind": kind, "event": fields}

    @classmethod
    def parse(cls, d: dict) -> "Update":
        fields = required(d, "event")
        if type(fields) is not dict:
            raise ChatError("event is not an object")
        return cls(integer(d, "seq", 1, MAX_SEQ), integer(d, "request", hi=MAX_REQUEST),
                   event_of(text(d, "kind", 16), fields))


CLASSES = {ChatType.ATTACH: Attach, ChatType.WELCOME: Welcome, ChatType.SUBMIT: Submit, ChatType.CANCEL: Cancel,
           ChatType.NEW_CHAT: NewChat, ChatType.GIVE_CODE: GiveCode, ChatType.UPDATE: Update, ChatType.ACK: Ack}
TYPES = {cls: kind for kind, cls in CLASSES.items()}
fits([(cls, cls.BOUNDS) for cls in CLASSES.values() if issubclass(cls, Tabled)])
Message = Attach | Welcome | Submit | Cancel | NewChat | GiveCode | Update | Ack


# -- frames ----------------------------------------------------------------------------------------
def encode(msg: Message) -> bytes:
    """One message as a frame; ChatError for one that ``decode`` would refuse."""
    if type(msg) not in TYPES:
        raise ChatError(f"{type(msg).__name__} is no chat message")
    try:
        body = to_json(msg.body())
    except (TypeError, ValueError) as exc:  # a WireError too: an event that does not travel
        raise ChatError(f"{type(msg).__name__} is not JSON: {exc}") from None
    frame = HEADER.pack(MAGIC, CHAT_VERSION, TYPES[type(msg)], len(body)) + body
    decode(frame)  # what the peer would refuse is refused here, where the bug is
    return frame


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
        data = from_json(frame[HEADER.size:])
    except (ValueError, RecursionError) as exc:
        raise ChatError(f"{cls.__name__} body is not JSON: {shown(str(exc))}") from None
    if type(data) is not dict:
        raise ChatError(f"{cls.__name__} body is not a JSON object")
    try:
        return cls.parse(data)
    except WireError as exc:
        raise ChatError(f"{cls.__name__}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a check this module missed: still refused
        raise ChatError(f"{cls.__name__}: malformed ({type(exc).__name__})") from None
