"""Frames built byte by byte, for tests that send what an encoder would refuse."""

from __future__ import annotations

from sfchat.protocol.wire import HEADER, MAGIC, PROTOCOL_VERSION


def frame(mtype: int, body: bytes, *, version: int = PROTOCOL_VERSION, flags: int = 0, rnd: int = 0,
          body_len: int | None = None, magic: bytes = MAGIC) -> bytes:
    """A hand-made frame, so that tests can break exactly one thing."""
    return HEADER.pack(magic, version, mtype, flags, rnd, len(body) if body_len is None else body_len) + body
