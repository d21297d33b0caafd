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
the queue is due, so a burst of frames is delayed once, not once per frame. With an emulated
bandwidth each direction is a link that carries one frame at a time at that rate: a frame is
due after the frames before it in that direction went through, plus its own bytes' time.

The outbox is bounded in frames and in bytes, and every outbox is a holder of the relay's one
``relay.budget.Budget``: a message counts from the moment it is queued until its socket has taken
it (``send`` returned), and while it is written it also counts ``send_slack(size)``: what its
socket's write buffer and one serialized fragment may hold beside it. A frame over
``FRAGMENT_BYTES`` is written as a fragmented message of pieces of that size, each taken from the
frame itself (no copy of the whole frame is ever made), and the socket's write buffer is capped at
``WRITE_LIMIT`` (websockets' ``write_limit``), so a receiver that stops reading holds its queue,
its frame in flight and at most ``send_slack`` more; between messages at most ``WRITE_LIMIT``
stays in its buffer. No reference to a delivered message outlives its delivery. A receiver too
slow to keep up is closed with a reason (code 1013) instead of letting the relay's memory grow;
when the shared budget runs out, the budget picks whom to close, and a peer's queue is freed at once.

Every close of a joined peer goes through ``Peer.close`` (or the budget's ``shed``): a close frame
cannot cut a fragmented message, so a polite close waits for the message being written, and the
whole close, that wait included, ends within the connection's ``close_timeout``, after which (or
at once, when shed hard) the socket is aborted.

This module does not know about HTTP, tokens or options (see ``relay.server``), and never
looks inside a frame.
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from relay.budget import Budget

ROLES = ("head", "tail")
OUTBOX_FRAMES = 4096
FRAGMENT_BYTES = 256 << 10  # larger frames are written as fragmented messages of pieces this size
WRITE_LIMIT = 16 << 10  # high-water mark of each socket's write buffer
CLOSE_TOO_SLOW = 1013  # "try again later": the receiver fell behind the relay's bounded queue

log = logging.getLogger("relay")


def other_role(role: str) -> str:
    return "tail" if role == "head" else "head"


def send_slack(size: int) -> int:
    """Bytes a message of ``size`` may keep alive beside itself while it is written: a full write
    buffer and the serialized fragment being added to it."""
    return min(size, FRAGMENT_BYTES) + WRITE_LIMIT


def fragments(frame: bytes):
    """``frame`` in pieces of ``FRAGMENT_BYTES``, each a view of it."""
    view = memoryview(frame)
    for start in range(0, len(view), FRAGMENT_BYTES):
        yield view[start:start + FRAGMENT_BYTES]


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

    def __init__(self, ws: ServerConnection, role: str, session: str, max_queued_bytes: int, budget: Budget,
                 client: str):
        self.ws = ws
        self.role = role
        self.session = session
        self.client = client
        self.address = address(ws)  # kept: the transport forgets it once closed
        self.told_dropped = False  # a "dropped" event was sent during the current absence
        self.link_free = 0.0  # when the emulated link towards this peer has carried what it was given
        self.last_heard = asyncio.get_running_loop().time()  # when the client last sent a message
        self._max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0  # messages queued, and the one being written
        self._slack = 0  # send_slack of the message being written
        self._writing = 0  # what the message being written keeps alive: itself and its slack
        self._between_messages = asyncio.Event()
        self._between_messages.set()
        self._budget = budget
        self._budget.holders.add(self)
        self._outbox: asyncio.Queue[tuple[float, bytes | str]] = asyncio.Queue(OUTBOX_FRAMES)
        self._closing: asyncio.Future | None = None
        self._delivery = asyncio.create_task(self._deliver())

    @property
    def held(self) -> int:
        """Bytes queued for this peer, plus the message being written and its slack."""
        return self._queued_bytes + self._slack

    @property
    def shedding(self) -> bool:
        return self._closing is not None

    def shed(self, linger_room: int) -> None:
        self.overflow("relay buffer full: this side reads too slowly", hard=self._writing > linger_room)

    def enqueue(self, message: bytes | str, deliver_at: float) -> None:
        """Queue a frame (bytes) or event (str) for delivery at ``deliver_at`` (loop time)."""
        if self._closing is not None:
            return
        if self._outbox.full() or self._queued_bytes + len(message) > self._max_queued_bytes:
            # a polite close keeps the frame in flight; beyond the budget's linger allowance, abort
            hard = self._budget.leaving() + self._writing > self._budget.linger
            self.overflow("relay send queue overflow: this side reads too slowly", hard)
            return
        self._queued_bytes += len(message)
        self._outbox.put_nowait((deliver_at, message))
        self._budget.charge(self, len(message))  # may shed this peer, which empties its queue

    def overflow(self, reason: str, hard: bool = False) -> None:
        """Close this peer as too slow (1013; ``hard``: abort the socket, the frame in flight with
        it) and free its queue now, not when it has closed."""
        if self._closing is None:
            log.warning("session %s: %s at %s: %s; closing it", self.session, self.role, self.address, reason)
            self._start_close(CLOSE_TOO_SLOW, reason, hard)

    async def close(self, code: int, reason: str) -> None:
        """Close with ``code`` and ``reason`` after the message being written (see the contract)."""
        if self._closing is None:
            self._start_close(code, reason, hard=False)
        await asyncio.shield(self._closing)

    def _start_close(self, code: int, reason: str, hard: bool) -> None:
        if hard:
            self.ws.transport.abort()
            self._delivery.cancel()  # lets go of the message being written at the next loop iteration
            self._closing = asyncio.get_running_loop().create_future()
            self._closing.set_result(None)
        else:
            self._closing = asyncio.create_task(self._close_politely(code, reason))
        self._discard()

    async def _close_politely(self, code: int, reason: str) -> None:
        try:
            async with asyncio.timeout(self.ws.close_timeout or 3.0):
                await self._between_messages.wait()
                await self.ws.close(code, reason)
        except TimeoutError:
            self.ws.transport.abort()

    def _discard(self) -> None:
        while not self._outbox.empty():
            size = len(self._outbox.get_nowait()[1])
            self._queued_bytes -= size
            self._budget.release(size)

    def event(self, **fields) -> None:
        """Queue a relay control event (a JSON text message), due now."""
        self.enqueue(json.dumps(fields, separators=(",", ":")), asyncio.get_running_loop().time())

    async def _deliver(self) -> None:
        try:
            while True:
                await self._deliver_next()
        except ConnectionClosed:
            pass  # the connection's own handler notices and leaves the session

    async def _deliver_next(self) -> None:
        """Write the next message; its references end with this call."""
        deliver_at, message = await self._outbox.get()
        size = len(message)
        self._slack = send_slack(size)
        self._writing = size + self._slack
        self._between_messages.clear()
        try:
            self._budget.charge(self, self._slack)  # may shed this peer
            delay = deliver_at - asyncio.get_running_loop().time()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._closing is None:  # once closing, nothing more is started
                # returns once the socket's buffer is low again
                await self.ws.send(message if size <= FRAGMENT_BYTES else fragments(message))
        except BaseException as exc:
            # The frames an exception passed through keep their locals (this message among them)
            # for as long as it lives, e.g. while a cancellation waits for stop() to collect it.
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            del message
            self._queued_bytes -= size
            self._budget.release(size + self._slack)
            self._writing = self._slack = 0
            self._between_messages.set()

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
        self.paired_at = 0.0  # loop time when the current head and tail were both present

    def partner(self, peer: Peer) -> Peer | None:
        """The other role's peer, unless absent or already closing."""
        other = self.peers.get(other_role(peer.role))
        return None if other is None or other.shedding else other

    def join(self, peer: Peer) -> None:
        other = self.peers.get(other_role(peer.role))
        self.peers[peer.role] = peer
        if other is not None:
            self.paired_at = asyncio.get_running_loop().time()
        peer.event(event="welcome", session=self.name, peer_present=other is not None)
        if other is not None:
            other.event(event="peer_joined", role=peer.role)

    def leave(self, peer: Peer) -> None:
        del self.peers[peer.role]
        other = self.peers.get(other_role(peer.role))
        if other is not None:
            other.told_dropped = False  # a new absence starts now
            other.event(event="peer_left", role=peer.role)

    def forward(self, sender: Peer, frame: bytes, delay: float, bytes_per_s: float = 0.0) -> None:
        """Pass ``frame`` to the other role ``delay`` seconds from now (and, over an emulated link
        of ``bytes_per_s``, once the frames before it and its own bytes went through), or drop it
        if absent."""
        other = self.peers.get(other_role(sender.role))
        if other is not None:
            now = asyncio.get_running_loop().time()
            if bytes_per_s > 0:
                other.link_free = max(now, other.link_free) + len(frame) / bytes_per_s
                now = other.link_free
            other.enqueue(frame, now + delay)
        elif not sender.told_dropped:
            sender.told_dropped = True
            sender.event(event="dropped", reason="no peer")
