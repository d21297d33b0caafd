"""PROGRESS and ERROR as typed messages, checked field by field on arrival like HELLO and READY.

Contract
--------
``Progress(stage, done, total, detail)`` is what a tail reports while it loads (``stage``:
"download", "load", "capture"...; ``done`` of ``total`` units; ``detail``: a file name, a shard).
``Failure(message, resync)`` is an ERROR: the peer refused a frame or failed on it; ``resync``
says that the tail lost (or never had) the head's context, which a fresh HELLO repairs.
``to_frame()`` encodes one as a wire Control frame; ``parse(data)`` builds one from a decoded
Control's JSON object and raises ``wire.WireError`` for a missing field, a value not of its
exact JSON type, an integer out of range or a text too long. Texts are kept as sent: whoever
shows one to a person passes it through ``plaintext.plain`` first. Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sfchat.protocol import wire
from sfchat.protocol.fields import json_field

MAX_STAGE_CHARS = 64
MAX_TEXT = 500  # characters of an ERROR message or a PROGRESS detail
MAX_COUNT = (1 << 62) - 1


@dataclass(frozen=True)
class Progress:
    stage: str
    done: int
    total: int
    detail: str = ""

    def to_frame(self) -> bytes:
        return wire.encode(wire.Control(wire.MsgType.PROGRESS, {
            "stage": self.stage[:MAX_STAGE_CHARS], "done": self.done, "total": self.total,
            "detail": self.detail[:MAX_TEXT]}))

    @classmethod
    def parse(cls, data: dict) -> "Progress":
        stage = json_field(data, "stage", str)
        detail = data.get("detail") or ""
        if type(detail) is not str:
            raise wire.WireError("a PROGRESS detail that is not a string")
        if len(stage) > MAX_STAGE_CHARS or len(detail) > MAX_TEXT:
            raise wire.WireError(f"a PROGRESS text longer than {MAX_STAGE_CHARS} / {MAX_TEXT} characters")
        return cls(stage, json_field(data, "done", int, hi=MAX_COUNT), json_field(data, "total", int, hi=MAX_COUNT), detail)


@dataclass(frozen=True)
class Failure:
    message: str
    resync: bool = False

    def to_frame(self) -> bytes:
        return wire.encode(wire.Control(wire.MsgType.ERROR, asdict(self) | {"message": self.message[:MAX_TEXT]}))

    @classmethod
    def parse(cls, data: dict) -> "Failure":
        message = data.get("message")
        if type(message) is not str or not message:
            raise wire.WireError("an ERROR without a message")
        return cls(message[:MAX_TEXT], json_field(data, "resync", bool, False))
