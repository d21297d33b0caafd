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

The outbox is bounded in frames and in bytes, and every outbox is a holder of the relay's one
``relay.budget.Budget``: a frame counts from the moment it is queued until the socket has taken
it (``send`` returned), so a receiver that stops reading holds at most one frame in its socket's
buffer beyond its queue, and that frame is counted too. A receiver too slow to keep up is closed
with a reason (code 1013) instead of letting the relay's memory grow; when the shared budget runs
out, the holder with the most bytes is the one closed, and a peer's queue is freed at once.

This module does not know about HTTP, tokens or options (see ``relay.server``), and never
looks inside a frame.
"""

from __future__ import annotations

import asyncio
import json
import logging

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from relay.budget import Budget

ROLES = ("head", "tail")
OUTBOX_FRAMES = 4096
CLOSE_TOO_SLOW = 1013  # "try again later": the receiver fell behind the relay's bounded queue

log = logging.getLogger("relay")


def other_role(role: str) -> str:
    return "tail" if role == "head" else "head"


async def close_firmly(ws: ServerConnection, code: int, reason: str) -> None:
    """Close with ``code``; a peer that reads nothing would stall the close frame behind the
    unsent data forever, so after ``close_timeout`` the TCP connection is simply cut."""
    try:
        await asyncio.wait_for(ws.close(code, reason), ws.close_timeout or 3.0)
    except TimeoutError:
        ws.transport.abort()


def address(ws: ServerConnection) -> str:
    """``host:port`` of the remote end, for log lines."""
    remote = ws.remote_address
    return f"{remote[0]}:{remote[1]}" if remote else "?"


def host(ws: ServerConnection) -> str:
    """The remote address without its port: what "once per peer" counts by."""
    remote = ws.remote_address
    return str(remote[0]) if remote else "?"


class Peer:
    """One connected websocket and the ordered queue of what the relay owes it."""

    def __init__(self, ws: ServerConnection, role: str, session: str, max_queued_bytes: int,
                 budget: Budget | None = None):
        self.ws = ws
        self.role = role
        self.session = session
        self.address = address(ws)  # kept: the transport forgets it once closed
        self.told_dropped = False  # a "dropped" event was sent during the current absence
        self._max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._in_flight = 0  # size of the frame being written to the socket
        self._budget = budget or Budget(1 << 62)
        self._budget.holders.add(self)
        self._outbox: asyncio.Queue[tuple[float, bytes | str]] = asyncio.Queue(OUTBOX_FRAMES)
        self._closing: asyncio.Task | None = None
        self._delivery = asyncio.create_task(self._deliver())

    @property
    def held(self) -> int:
        """Bytes queued for this peer, plus the frame being written to its socket."""
        return self._queued_bytes

    @property
    def shedding(self) -> bool:
        return self._closing is not None

    def shed(self, linger_room: int) -> None:
        self.overflow("relay buffer full: this side reads too slowly", hard=self._in_flight > linger_room)

    def enqueue(self, message: bytes | str, deliver_at: float) -> None:
        """Queue a frame (bytes) or event (str) for delivery at ``deliver_at`` (loop time)."""
        if self._closing is not None:
            return
        if self._outbox.full() or self._queued_bytes + len(message) > self._max_queued_bytes:
            # a polite close keeps the frame in flight; beyond the budget's linger allowance, abort
            hard = self._budget.leaving() + self._in_flight > self._budget.linger
            self.overflow("relay send queue overflow: this side reads too slowly", hard)
            return
        self._queued_bytes += len(message)
        self._outbox.put_nowait((deliver_at, message))
        self._budget.charge(self, len(message))  # may shed this peer, which empties its queue

    def overflow(self, reason: str, hard: bool = False) -> None:
        """Close this peer as too slow (1013; ``hard``: abort the socket, the frame in flight with
        it) and free its queue now, not when it has closed."""
        if self._closing is not None:
            return
        log.warning("session %s: %s at %s: %s; closing it", self.session, self.role, self.address, reason)
        if hard:
            self.ws.transport.abort()
            self._closing = asyncio.create_task(asyncio.sleep(0))
        else:
            self._closing = asyncio.create_task(close_firmly(self.ws, CLOSE_TOO_SLOW, reason))
        self._discard()

    def _discard(self) -> None:
        while not self._outbox.empty():
            self._release(len(self._outbox.get_nowait()[1]))

    def _release(self, size: int) -> None:
        self._queued_bytes -= size
        self._budget.used -= size

    def event(self, **fields) -> None:
        """Queue a relay control event (a JSON text message), due now."""
        self.enqueue(json.dumps(fields, separators=(",", ":")), asyncio.get_running_loop().time())

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                deliver_at, message = await self._outbox.get()
                self._in_flight = len(message)
                try:
                    delay = deliver_at - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await self.ws.send(message)  # returns once the socket's buffer is low again
                finally:
                    self._in_flight = 0
                    self._release(len(message))
        except ConnectionClosed:
            pass  # the connection's own handler notices and leaves the session

    async def stop(self) -> None:
        """Stop delivering; whatever is still queued for this peer is discarded."""
        self._delivery.cancel()
        try:
            await self._delivery
        except asyncio.CancelledError:
            pass
        self._discard()
        self._budget.holders.discard(self)


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
