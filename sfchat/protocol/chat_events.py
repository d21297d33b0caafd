"""What a chat ``Update`` carries: the runtime events of ``sfchat.events`` as JSON bodies, and back.

Contract
--------
Each event that travels to a chat client has a name on the wire (its *kind*) and a table of the
bounds of its fields (``TABLES``), written in the order of its fields; ``event_body(event)`` is
its kind and body, ``event_of(kind, body)`` checks a peer's body field by field and builds the
event again, ``update_event`` makes what a person will see of it plain. All three walk the table,
and a table that names other fields than its dataclass stops the import: a field added to an
event travels, or the import says which table lacks it. The bound of a field says how it is sent
(a text cut to its bound where a longer one would be refused; a choice sent as it is), checked
(its exact JSON type, its range) and shown (a one-line text through ``plaintext.plain``, a reply's
text through ``reply_text``, which keeps its line breaks; numbers as they are).

A ``ReplyFinished`` travels as a ``Finished``: its figures and the count of its tokens, its text
only where that is not the text streamed before it (``text``: None otherwise), so a finished reply
never travels twice; ``finished_event`` rebuilds the ``ReplyFinished``. ``event_of`` raises
``wire.WireError`` (``protocol.chat`` makes it a ``ChatError``) for a missing field, a value not of
its exact type or out of its bounds, a kind it does not know; ``event_body`` for an event that does
not travel. Torch-free; imports nothing of sfchat but the checks of ``fields``, the wire's error,
the events and ``plaintext``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from sfchat.events import (
    CodeWanted, LinkState, LoadProgress, ReplyFinished, ReplyStarted, RoundStats, RuntimeFailed, RuntimeReady,
    TokensCommitted,
)
from sfchat.plaintext import plain
from sfchat.protocol.fields import MAX_EXACT, array, cut, flag, integer, ints, number, required, shown, text
from sfchat.protocol.wire import WireError

MAX_NAME = 512  # model ids, devices, dtypes
MAX_TEXT = 2000  # details, reasons, failure messages (what ``plain`` shows at most)
MAX_CHUNK_CHARS = 1 << 16  # the text of one round's tokens
MAX_CHUNK_TOKENS = 1 << 12
MAX_REPLY_CHARS = 1 << 19  # a finished reply's text, when it travels at all
MAX_HISTOGRAM = 1 << 10
MAX_SHAPES = 16
MAX_MS = 1e9  # figures in milliseconds (11 days), seconds below, tok/s, bytes: all finite and bounded
MAX_COUNT = MAX_EXACT
LINK_STATES = ("local", "waiting", "connected", "stalled", "reconnecting", "closed")
NODES = ("head", "tail", "draft")
FINISH_REASONS = ("eos", "length", "context", "cancelled")
MODES = ("local", "relay")
REPLY_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def reply_text(value: str) -> str:
    """A reply's text from a peer, safe to render: no escape sequence or control character, its
    line breaks and tabs kept (without ESC and C1 no terminal sequence can start)."""
    return REPLY_CONTROLS.sub("", value.replace("\r\n", "\n"))


# -- bounds: how one field is sent, checked and shown ------------------------------------------------
class Bound:
    """A field sent (``send``) and shown (``show``) as it is; ``take(data, key)`` checks it in a peer's body."""

    def send(self, value):
        return value

    def show(self, value):
        return value


@dataclass(frozen=True)
class Whole(Bound):
    lo: int = 0
    hi: int = MAX_COUNT

    def take(self, data: dict, key: str) -> int:
        return integer(data, key, self.lo, self.hi)


@dataclass(frozen=True)
class Number(Bound):
    hi: float = MAX_MS

    def take(self, data: dict, key: str) -> float:
        return number(data, key, 0.0, self.hi)


@dataclass(frozen=True)
class Flag(Bound):
    def take(self, data: dict, key: str) -> bool:
        return flag(data, key)


@dataclass(frozen=True)
class Choice(Bound):
    """One of ``choices``, sent as it is (the encoder refuses any other)."""

    choices: tuple[str, ...]
    most: int = 16

    def take(self, data: dict, key: str) -> str:
        return text(data, key, self.most, choices=self.choices)


@dataclass(frozen=True)
class Text(Bound):
    """A one-line text of at most ``most`` characters (at least one unless ``empty``)."""

    most: int
    empty: bool = True

    def send(self, value: str) -> str:
        return cut(value, self.most)

    def take(self, data: dict, key: str) -> str:
        return text(data, key, self.most, self.empty)

    def show(self, value: str) -> str:
        return plain(value)


@dataclass(frozen=True)
class Reply(Bound):
    """A reply's text, cut to ``most`` for the wire (``cut`` False: sent whole, refused past it)."""

    most: int
    cut: bool = True

    def send(self, value: str) -> str:
        return cut(value, self.most) if self.cut else value

    def take(self, data: dict, key: str) -> str:
        return text(data, key, self.most)

    def show(self, value: str) -> str:
        return reply_text(value)


@dataclass(frozen=True)
class Maybe(Bound):
    """``bound``'s value, or None (a missing key reads as None)."""

    bound: Bound

    def send(self, value):
        return None if value is None else self.bound.send(value)

    def take(self, data: dict, key: str):
        return None if data.get(key) is None else self.bound.take(data, key)

    def show(self, value):
        return None if value is None else self.bound.show(value)


@dataclass(frozen=True)
class Wholes(Bound):
    most: int
    hi: int = (1 << 31) - 1

    def send(self, value) -> list:
        return list(value)

    def take(self, data: dict, key: str) -> tuple[int, ...]:
        return ints(data, key, self.most, self.hi)


@dataclass(frozen=True)
class Texts(Bound):
    """At most ``most`` one-line texts of at most ``each`` characters (the encoder cuts both)."""

    most: int
    each: int

    def send(self, value) -> list:
        return [cut(s, self.each) for s in value[:self.most]]

    def take(self, data: dict, key: str) -> tuple[str, ...]:
        items = array(data, key, self.most)
        if any(type(s) is not str or len(s) > self.each for s in items):
            raise WireError(f"{key} holds something other than short strings")
        return tuple(items)

    def show(self, value) -> tuple[str, ...]:
        return tuple(plain(s) for s in value)


@dataclass(frozen=True)
class Record(Bound):
    """A nested dataclass ``cls``, its fields bounded by ``table``."""

    cls: type
    table: dict

    def send(self, value) -> dict:
        return sent(value, self.table)

    def take(self, data: dict, key: str):
        value = required(data, key)
        if type(value) is not dict:
            raise WireError(f"{key} is not an object")
        return self.cls(**taken(self.table, value))

    def show(self, value):
        return show_fields(value, self.table)


def sent(obj, table: dict) -> dict:
    return {key: bound.send(getattr(obj, key)) for key, bound in table.items()}


def taken(table: dict, data: dict) -> dict:
    return {key: bound.take(data, key) for key, bound in table.items()}


def show_fields(obj, table: dict):
    return dataclasses.replace(obj, **{key: bound.show(getattr(obj, key)) for key, bound in table.items()})


def fits(tables) -> None:
    """Stop the import where a table (class, the names it bounds) names other fields than its class has."""
    for cls, names in tables:
        own = {f.name for f in dataclasses.fields(cls)}
        if set(names) != own:
            raise ImportError(f"the chat codec's table for {cls.__name__} differs from its fields in "
                              f"{sorted(own ^ set(names))}")


# -- the tables --------------------------------------------------------------------------------------
STATS_BOUNDS = {"accepted": Whole(hi=MAX_CHUNK_TOKENS), "committed": Whole(hi=MAX_CHUNK_TOKENS),
                "draft_ms": Number(), "head_ms": Number(), "tail_ms": Number(), "rtt_ms": Number(),
                "round_ms": Number(), "wait_ms": Number(), "overlap_ms": Number(), "speculated": Flag(),
                "forward_bytes": Whole(), "tree_nodes": Whole(hi=MAX_CHUNK_TOKENS),
                "depth": Whole(hi=MAX_CHUNK_TOKENS), "in_flight": Whole(hi=MAX_CHUNK_TOKENS),
                "draft_steps": Whole(), "expected": Number(hi=MAX_CHUNK_TOKENS), "ahead_steps": Whole(),
                "schedule": Text(16)}
TABLES = {
    LoadProgress: ("progress", {"node": Choice(NODES), "stage": Text(64, empty=False), "done": Whole(),
                                "total": Whole(), "detail": Text(MAX_TEXT)}),
    RuntimeReady: ("ready", {
        "model": Text(MAX_NAME, empty=False), "draft": Text(MAX_NAME, empty=False), "split": Whole(hi=1 << 12),
        "n_layers": Whole(hi=1 << 12), "dtype": Text(MAX_NAME), "k": Whole(hi=1 << 10), "device": Text(MAX_NAME),
        "mode": Choice(MODES, 8), "max_context": Whole(1, 1 << 24), "quant": Text(MAX_NAME),
        "tail_dtype": Text(MAX_NAME), "tree_budget": Whole(hi=1 << 20), "shapes": Texts(MAX_SHAPES, 64),
        "max_in_flight": Whole(hi=1 << 10)}),
    LinkState: ("link", {"state": Choice(LINK_STATES), "detail": Text(MAX_TEXT)}),
    ReplyStarted: ("started", {"prompt_tokens": Whole(), "reused_tokens": Whole(), "prefill_tokens": Whole(),
                               "dropped_turns": Whole()}),
    TokensCommitted: ("tokens", {"text": Reply(MAX_CHUNK_CHARS), "token_ids": Wholes(MAX_CHUNK_TOKENS),
                                 "stats": Record(RoundStats, STATS_BOUNDS), "elapsed_s": Number()}),
    CodeWanted: ("code_wanted", {"reason": Text(MAX_TEXT)}),
    RuntimeFailed: ("failed", {"message": Text(MAX_TEXT), "fatal": Flag()}),
}
KINDS = {kind: (cls, table) for cls, (kind, table) in TABLES.items()}
# a Finished's own fields, then its figures: the floats of ReplyFinished, each a Number()
FINISHED = {"finish_reason": Choice(FINISH_REASONS), "text": Maybe(Reply(MAX_REPLY_CHARS, cut=False)),
            "tokens": Whole(), "prompt_tokens": Whole(), "rounds": Whole(),
            "accepted_histogram": Wholes(MAX_HISTOGRAM, MAX_COUNT), "tree_budget": Whole(hi=1 << 20)}
FIGURES = ("tps", "ttft_s", "prefill_s", "round_ms", "rtt_ms", "draft_ms", "head_ms", "tail_ms", "wait_ms",
           "overlap_ms", "in_flight_mean", "depth_mean", "forward_bytes", "tokens_per_round", "hit_rate")
FIGURE = Number()
SAME = tuple(key for key in FINISHED if key not in ("text", "tokens"))  # as the ReplyFinished has them


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
        return cls(text=own, tokens=len(event.token_ids), figures={k: getattr(event, k) for k in FIGURES},
                   **{k: getattr(event, k) for k in SAME})

    @classmethod
    def parse(cls, d: dict) -> "Finished":
        return cls(**taken(FINISHED, d), figures={k: FIGURE.take(d, k) for k in FIGURES})

    def body(self) -> dict:
        return sent(self, FINISHED) | self.figures


def finished_event(f: Finished, streamed: str, token_ids: tuple[int, ...]) -> ReplyFinished:
    """The head's ``ReplyFinished`` again, from its figures and what the client streamed."""
    return ReplyFinished(text=streamed if f.text is None else f.text, token_ids=token_ids,
                         **{k: getattr(f, k) for k in SAME}, **f.figures)


fits([*((cls, table) for cls, (_, table) in TABLES.items()), (RoundStats, STATS_BOUNDS),
      (Finished, [*FINISHED, "figures"]), (ReplyFinished, [*SAME, "text", "token_ids", *FIGURES])])


# -- events as bodies, and back ----------------------------------------------------------------------
def event_body(event) -> tuple[str, dict]:
    """An event's kind and fields for the wire, every text cut to its bound."""
    if isinstance(event, Finished):
        return "finished", event.body()
    if type(event) not in TABLES:
        raise WireError(f"{type(event).__name__} does not travel to a chat client")
    kind, table = TABLES[type(event)]
    return kind, sent(event, table)


def event_of(kind: str, d: dict):
    """The event of ``kind`` from a peer's body, checked field by field."""
    if kind == "finished":
        return Finished.parse(d)
    if kind not in KINDS:
        raise WireError(f"an update of unknown kind {shown(kind)}")
    cls, table = KINDS[kind]
    return cls(**taken(table, d))


def update_event(u):
    """The event an update ``u`` carries, as a person may see it: every one-line text plain
    (``plaintext.plain``), a reply's text freed of control characters; a ``Finished`` stays one."""
    return show_fields(u.event, FINISHED if isinstance(u.event, Finished) else TABLES[type(u.event)][1])
