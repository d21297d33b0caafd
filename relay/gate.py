"""Every TCP connection the relay accepts, from accept to close: counted, capped and metered.

Contract
--------
``MeteredConnection`` is the websockets ``ServerConnection`` the relay serves with
(``create_connection=``); ``Gate`` is the bookkeeping they share.

File descriptors. The gate counts every accepted socket until its ``connection_lost``, which is
exactly when asyncio closes it. Past ``max_open`` (set by ``relay.server`` below RLIMIT_NOFILE,
keeping room for one accept batch, the listening sockets and the log) a new socket is aborted
at once, so ``accept()`` never fails for want of a descriptor.

Clients. Limits per client count by ``client_key``: the remote IPv4 address, or the /64 network
of an IPv6 address (what one host is usually given, so that rotating addresses inside it does not
make one client many).

Before the handshake. A connection is *pending* from accept until the relay's handler starts
(its request passed every check and was upgraded) or until it closes. At most
``max_pending_per_host`` are pending per client and ``max_pending`` in all. A newcomer
over either limit evicts (aborts) the oldest pending connection of its own address, or of the
address with the most pending connections: an idle or slow client displaces itself, and an
honest client's one fresh handshake is displaced only by clients from more than
``max_pending`` addresses. websockets' ``open_timeout`` ends any handshake that takes too long,
and a handshake request over ``MAX_REQUEST_BYTES`` is aborted.

Memory. Each connection is a ``relay.budget.Budget`` holder of its inbound bytes: what its
websockets parser holds of a frame still arriving plus data frames received but not yet taken by
the relay's handler (``consumed``). When the budget sheds one, its socket is aborted and the
frame it was receiving freed at once. websockets' parser keeps the last frame it parsed until
the next one is complete, so a payload would outlive its delivery by as long as the sender stays
quiet: the frame handed on to the handler is a new one with the payload, and the parser's own
keeps an empty payload.

Activity. ``last_frame`` is when the connection last sent a frame of any kind, a keepalive ping
or pong included (what the relay's idle timeout counts).

This module reads three websockets internals (``protocol.reader.buffer``: the bytes received and
not yet parsed into a frame, cleared when shed; ``process_event``: each parsed frame; and
``Frame.data``, replaced as said); tests/relay/test_relay_memory.py fails if they move. It knows
nothing of sessions or tokens.
"""

from __future__ import annotations

import asyncio
import ipaddress

from websockets.asyncio.server import ServerConnection
from websockets.frames import DATA_OPCODES, Frame
from websockets.protocol import State

from relay.budget import Budget
from relay.logs import LogOnce

MAX_REQUEST_BYTES = 16 << 10  # an sfchat client's handshake request is under 1 KiB


def client_key(host: str) -> str:
    """Who a remote address counts as: an IPv4 address itself (also when IPv4-mapped), an IPv6
    address its /64 network."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class Gate:
    """Open and pending connections, by client, for one relay."""

    def __init__(self, budget: Budget, refused: LogOnce, max_open: int, max_pending: int,
                 max_pending_per_host: int):
        self.budget, self.refused = budget, refused
        self.max_open, self.max_pending, self.max_pending_per_host = max_open, max_pending, max_pending_per_host
        self.open = 0
        self.pending: dict[str, dict[MeteredConnection, None]] = {}  # client -> oldest first
        self.n_pending = 0

    def admit(self, conn: "MeteredConnection") -> None:
        self.open += 1
        self.budget.holders.add(conn)
        if self.open > self.max_open:
            self.refused(conn.host, "fds", "refused %s: %d connections open, the most file descriptors allow",
                         conn.host, self.max_open)
            conn.transport.abort()
            return
        own = self.pending.get(conn.client, {})
        if len(own) >= self.max_pending_per_host:
            self._evict(next(iter(own)), f"{len(own)} handshakes pending from its address")
        elif self.n_pending >= self.max_pending:
            crowded = max(self.pending.values(), key=len)
            self._evict(next(iter(crowded)), f"{self.n_pending} handshakes pending in all")
        self.pending.setdefault(conn.client, {})[conn] = None
        self.n_pending += 1

    def settle(self, conn: "MeteredConnection") -> None:
        """``conn`` is no longer pending: upgraded, evicted or gone."""
        own = self.pending.get(conn.client)
        if own is not None and own.pop(conn, False) is None:
            self.n_pending -= 1
            if not own:
                del self.pending[conn.client]

    def forget(self, conn: "MeteredConnection") -> None:
        self.settle(conn)
        self.open -= 1
        self.budget.holders.discard(conn)

    def _evict(self, victim: "MeteredConnection", why: str) -> None:
        self.refused(victim.host, "pending", "closed a pending handshake from %s: %s", victim.host, why)
        self.settle(victim)
        victim.transport.abort()


class MeteredConnection(ServerConnection):
    """A websockets server connection that reports to a ``Gate`` and meters its inbound bytes."""

    def __init__(self, protocol, server, *, gate: Gate, **options):
        super().__init__(protocol, server, **options)
        self.gate = gate
        self.host = self.client = "?"
        self._held = 0  # bytes charged to the budget
        self._assembled = 0  # data-frame bytes parsed and not yet consumed by the handler
        self._request_bytes = 0
        self._shed = False
        self._lost = False
        self.last_frame = self.loop.time()  # when a frame of any kind last came in

    @property
    def held(self) -> int:
        return self._held

    @property
    def shedding(self) -> bool:
        return self._shed

    def shed(self, linger_room: int = 0) -> None:
        self._shed = True  # always at once: a frame half received is of no use to anyone
        self.gate.refused(self.host, "buffer", "closed %s: relay buffer full while it held %d bytes of "
                          "unfinished messages", self.host, self._held)
        self.transport.abort()
        self.protocol.reader.buffer.clear()  # of no use now: freed at once, not when the socket is gone
        self._meter()

    def consumed(self, size: int) -> None:
        """The handler took a message of ``size`` bytes from this connection."""
        self._assembled -= size
        self._meter()

    # asyncio.Protocol and websockets hooks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        remote = transport.get_extra_info("peername")
        self.host = str(remote[0]) if remote else "?"
        self.client = client_key(self.host)
        self.gate.admit(self)

    def data_received(self, data: bytes) -> None:
        if self.protocol.state is State.CONNECTING:
            self._request_bytes += len(data)
            if self._request_bytes > MAX_REQUEST_BYTES:
                self.gate.refused(self.host, "request", "closed %s: handshake request over %d bytes",
                                  self.host, MAX_REQUEST_BYTES)
                self.transport.abort()
                return
        super().data_received(data)
        self._meter()

    def process_event(self, event) -> None:
        if isinstance(event, Frame):
            self.last_frame = self.loop.time()  # any frame, keepalive pings and pongs too: the client lives
        if isinstance(event, Frame) and event.opcode in DATA_OPCODES:
            self._assembled += len(event.data)
            handed_on = Frame(event.opcode, event.data, event.fin)
            event.data = b""  # the parser's reference: it keeps this frame until the next one
            event = handed_on
        super().process_event(event)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._lost = True
        self.gate.budget.release(self._held)
        self._held = 0
        self.gate.forget(self)

    def _meter(self) -> None:
        if self._lost:
            return
        held = len(self.protocol.reader.buffer) + self._assembled
        delta, self._held = held - self._held, held
        if delta > 0:
            self.gate.budget.charge(self, delta)
        elif delta < 0:
            self.gate.budget.release(-delta)
