"""The in-memory link of local mode: the tail's ``Verifier`` in the same process and thread.

Contract: the same ``send(frame)`` / ``recv(timeout)`` / ``closed_reason`` / ``close()`` surface as the relay link,
carrying the same encoded frames, so local mode exercises the wire codec exactly as relay mode
does; only the transport differs. ``send`` only queues a frame; the tail's work runs inside the
``recv`` that waits for its answer, so the head's clocks see it as waiting, not as sending.
``last_arrival`` is when the answer being returned was made (``time.perf_counter``).
``overlaps`` is False: the tail computes on the caller's thread, so nothing done between
``send`` and ``recv`` overlaps it.
"""

from __future__ import annotations

import time
from collections import deque

from sfchat.engine.verifier import TailError
from sfchat.link import LinkClosed


class MemoryLink:
    overlaps = False

    def __init__(self, verifier):
        self.verifier = verifier
        self.outbox: deque[bytes] = deque()
        self.inbox: deque[tuple[float, bytes]] = deque()
        self.closed = False
        self.last_arrival: float | None = None

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise LinkClosed("link closed")
        self.outbox.append(bytes(frame))

    def recv(self, timeout: float | None = None) -> bytes:
        while not self.inbox and self.outbox:
            try:
                self.verifier.handle(self.outbox.popleft(),
                                     lambda reply: self.inbox.append((time.perf_counter(), reply)))
            except TailError:
                pass  # its ERROR reply is in the inbox, as a relay tail would have sent it
        if not self.inbox:
            raise LinkClosed("the in-process tail sent no reply")
        self.last_arrival, frame = self.inbox.popleft()
        return frame

    @property
    def closed_reason(self) -> str | None:
        return "link closed" if self.closed else None

    def close(self) -> None:
        self.closed = True
