"""Pairing and ordered forwarding inside one relay session.

Contract
--------
A ``Session`` holds at most one ``Peer`` per role ("head", "tail"). Everything the relay
owes a peer -- frames forwarded from the other role and the relay's own JSON events -- goes
through that peer's outbox, one FIFO per forwarding direction, drained by one delivery task.
Because there is a single FIFO per direction, events never overtake frames: a ``peer_left``
arrives after every frame the departed peer managed to send.

Each outbox entry carries the time at which it may be delivered. With an emulated RTT a
frame is due ``rtt / 2`` after it arrived; the delivery task sleeps only until the head of
the queue is due, so a burst of frames is delayed once, not once per frame.

The outbox is bounded in frames and in bytes. A receiver too slow to keep up is closed with
a reason (code 1013) instead of letting the relay's memory grow.

This module does not know about HTTP, tokens or options (see ``relay.server``), and never
looks inside a frame.
"""

from __future__ import annotations

import asyncio
import json
import logging

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

ROLES = ("head", "tail")
OUTBOX_FRAMES = 4096
CLOSE_TOO_SLOW = 1013  # "try again later": the receiver fell behind the relay's bounded queue

log = logging.getLogger("relay")


def other_role(role: str) -> str:
    return "tail" if role == "head" else "head"


def address(ws: ServerConnection) -> str:
    """``host:port`` of the remote end, for log lines."""
    remote = ws.remote_address
    return f"{remote[0]}:{remote[1]}" if remote else "?"


class Peer:
    """One connected websocket and the ordered queue of what the relay owes it."""

    def __init__(self, ws: ServerConnection, role: str, session: str, max_queued_bytes: int):
        self.ws = ws
        self.role = role
        self.session = session
        self.address = address(ws)  # kept: the transport forgets it once closed
        self.told_dropped = False  # a "dropped" event was sent during the current absence
        self._max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._outbox: asyncio.Queue[tuple[float, bytes | str]] = asyncio.Queue(OUTBOX_FRAMES)
        self._closing: asyncio.Task | None = None
        self._delivery = asyncio.create_task(self._deliver())

    def enqueue(self, message: bytes | str, deliver_at: float) -> None:
        """Queue a frame (bytes) or event (str) for delivery at ``deliver_at`` (loop time)."""
        if self._closing is not None:
            return
        if self._outbox.full() or self._queued_bytes + len(message) > self._max_queued_bytes:
            log.warning("session %s: %s at %s reads too slowly, closing it",
                        self.session, self.role, self.address)
            self._closing = asyncio.create_task(
                self.ws.close(CLOSE_TOO_SLOW, "relay send queue overflow: this side reads too slowly"))
            return
        self._queued_bytes += len(message)
        self._outbox.put_nowait((deliver_at, message))

    def event(self, **fields) -> None:
        """Queue a relay control event (a JSON text message), due now."""
        self.enqueue(json.dumps(fields, separators=(",", ":")), asyncio.get_running_loop().time())

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                deliver_at, message = await self._outbox.get()
                self._queued_bytes -= len(message)
                delay = deliver_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self.ws.send(message)
        except ConnectionClosed:
            pass  # the connection's own handler notices and leaves the session

    async def stop(self) -> None:
        """Stop delivering; whatever is still queued for this peer is discarded."""
        self._delivery.cancel()
        try:
            await self._delivery
        except asyncio.CancelledError:
            pass


class Session:
    """At most one head and one tail sharing a name."""

    def __init__(self, name: str):
        self.name = name
        self.peers: dict[str, Peer] = {}

    def join(self, peer: Peer) -> None:
        other = self.peers.get(other_role(peer.role))
        self.peers[peer.role] = peer
        peer.event(event="welcome", session=self.name, peer_present=other is not None)
        if other is not None:
            other.event(event="peer_joined", role=peer.role)

    def leave(self, peer: Peer) -> None:
        del self.peers[peer.role]
        other = self.peers.get(other_role(peer.role))
        if other is not None:
            other.told_dropped = False  # a new absence starts now
            other.event(event="peer_left", role=peer.role)

    def forward(self, sender: Peer, frame: bytes, delay: float) -> None:
        """Pass ``frame`` to the other role ``delay`` seconds from now, or drop it if absent."""
        other = self.peers.get(other_role(sender.role))
        if other is not None:
            other.enqueue(frame, asyncio.get_running_loop().time() + delay)
        elif not sender.told_dropped:
            sender.told_dropped = True
            sender.event(event="dropped", reason="no peer")
