"""A listener's handler for the link tests: it echoes every frame and records what it was told."""

from __future__ import annotations


class Recorder:
    """A handler that echoes every frame and records what the listener told it."""

    def __init__(self) -> None:
        self.taken: list[bytes] = []
        self.said: list[str] = []

    def take(self, frame: bytes, link) -> None:
        self.taken.append(frame)
        link.send(b"echo " + frame)

    def tick(self, link) -> None:
        pass

    def peer_gone(self) -> None:
        self.said.append("gone")

    def pairing_ended(self, link, exc) -> None:
        self.said.append(f"ended: {exc}")

    def link_lost(self) -> None:
        self.said.append("lost")
