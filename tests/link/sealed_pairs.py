"""What the sealing, pairing and resumption tests share: a meddling relay in memory, two sealed
ends paired through it, a fuzzing profile, and the byte strings two captures share."""

from __future__ import annotations

import queue
import threading

from hypothesis import HealthCheck, settings

from sfchat.link import PeerGone
from sfchat.link.secure import SecureLink


SECRET = "7-crossover-clockwork"


class Relay:
    """Joins a head and a tail like sfchat-relay; ``tap(sender_role, frame) -> frames`` may meddle."""

    def __init__(self):
        self.ends: dict[str, End] = {}
        self.captured: list[tuple[str, bytes]] = []
        self.tap = None

    def join(self, role: str) -> "End":
        end = End(self, role)
        self.ends[role] = end
        return end

    def leave(self, role: str) -> None:
        del self.ends[role]
        other = self.ends.get("tail" if role == "head" else "head")
        if other is not None:
            other.inbox.put(PeerGone(f"the {role} left the session"))

    def deliver(self, to_role: str, frame: bytes) -> None:
        self.ends[to_role].inbox.put(frame)


class End:
    def __init__(self, relay: Relay, role: str):
        self.relay, self.role, self.other = relay, role, "tail" if role == "head" else "head"
        self.inbox: queue.Queue = queue.Queue()

    @property
    def peer_present(self) -> bool:
        return self.other in self.relay.ends

    def send(self, frame) -> None:
        frame = bytes(frame)
        self.relay.captured.append((self.role, frame))
        if self.other not in self.relay.ends:
            return  # dropped, as the relay does for an absent peer
        for out in (self.relay.tap(self.role, frame) if self.relay.tap else [frame]):
            self.relay.deliver(self.other, out)

    def recv(self, timeout=None) -> bytes:
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("nothing") from None
        if isinstance(item, Exception):
            raise item
        return item

    def wait_peer(self, timeout=None) -> None:
        assert self.peer_present

    def close(self) -> None:
        pass


def handshake_both(head: SecureLink, tail: SecureLink, timeout: float = 30) -> None:
    """Pair the two ends, the tail's side in a thread (the head opens, the tail answers)."""
    errors = []
    worker = threading.Thread(target=lambda: _keep_error(errors, tail.handshake, timeout))
    worker.start()
    try:
        head.handshake(timeout)
    finally:
        worker.join(timeout)
    if errors:
        raise errors[0]


def _keep_error(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # handed to the test's thread
        errors.append(exc)


def pair(relay: Relay | None = None, head_secret: str = SECRET, tail_secret: str = SECRET, session: str = "s1"):
    relay = relay or Relay()
    tail = SecureLink(relay.join("tail"), tail_secret, session, "tail")
    head = SecureLink(relay.join("head"), head_secret, session, "head")
    handshake_both(head, tail)
    return relay, head, tail


def fuzz(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def shared_windows(a: list[bytes], b: list[bytes], width: int = 8, skip: int = 8) -> list[bytes]:
    """Byte strings of ``width`` that frames of ``a`` (past their first ``skip`` header bytes) share
    with frames of ``b``."""
    other = b"\xff".join(b)
    return [f[i:i + width] for f in a for i in range(skip, len(f) - width + 1) if f[i:i + width] in other]
