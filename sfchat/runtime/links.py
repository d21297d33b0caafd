"""The in-memory link of local mode: the tail's ``Verifier`` in the same process and thread.

Contract: the same ``send(frame)`` / ``recv(timeout)`` / ``close()`` surface as the relay link,
carrying the same encoded frames, so local mode exercises the wire codec exactly as relay mode
does; only the transport differs. Calls are synchronous: ``send`` runs the tail's work at once
and queues its replies for ``recv``.
"""

from __future__ import annotations

from collections import deque


class MemoryLink:
    def __init__(self, verifier):
        self.verifier = verifier
        self.inbox: deque[bytes] = deque()
        self.closed = False

    def send(self, frame: bytes) -> None:
        if self.closed:
            raise ConnectionError("link closed")
        self.verifier.handle(bytes(frame), self.inbox.append)

    def recv(self, timeout: float | None = None) -> bytes:
        if not self.inbox:
            raise ConnectionError("the in-process tail sent no reply")
        return self.inbox.popleft()

    def close(self) -> None:
        self.closed = True
