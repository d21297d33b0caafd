"""Connections before their requests: a deadline for each, and caps per client address and in total.

Contract
--------
uvicorn's own ``limit_concurrency`` counts sockets, idle ones included, and answers 503 before
any key is checked; nothing of uvicorn's times out a connection before its first request. So
``sfchat --serve`` runs uvicorn without it and puts a ``ConnectionGate`` in front of uvicorn's h11
protocol instead (``gate.protocol()`` is the class given as uvicorn's ``http``):

* A connection is *waiting* from the moment it opens, and again after each response, until the
  headers of its next request are complete. It has ``header_timeout`` seconds for that, however
  many bytes it sends meanwhile: a deadline a peer cannot extend. Then it is closed, with a
  ``408`` if part of a request had come (reason ``header_timeout``), silently if nothing had
  (``idle_timeout``: an idle keep-alive connection ends the same way).
* At most ``max_waiting_per_client`` connections from one client address and ``max_waiting`` in
  all may wait. A newcomer over a limit closes the oldest waiting connection of its own address
  (``client_connections``), or of the most crowded address (``connections``): sockets that never
  send a request cannot crowd out a client that does.
* Requests, once their headers are complete, are counted and bounded by the app
  (``app.Guard``), not here; a connection busy with a request is not waiting.

Every connection closed by the gate counts in ``metrics.refused(reason)``. A client address is
the socket's peer address, an IPv6 address by its /64 (``client_key``; uvicorn's proxy headers
are off). Runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from sfchat.serve.metrics import ServerMetrics


@dataclass(frozen=True)
class GateLimits:
    header_timeout: float = 10.0  # seconds a connection may wait for its request's headers
    max_waiting: int = 512  # connections waiting for a request, all clients together
    max_waiting_per_client: int = 64  # the same, from one client address

    def __post_init__(self):
        if not (self.header_timeout > 0 and self.max_waiting >= 1 and self.max_waiting_per_client >= 1):
            raise ValueError(f"gate limits must be positive: {self}")


def client_key(host: str) -> str:
    """Who a remote address counts as: an IPv4 address itself (also when IPv4-mapped), an IPv6
    address its /64 network (what one host is usually given), as the relay counts them."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class ConnectionGate:
    def __init__(self, limits: GateLimits, metrics: ServerMetrics):
        self.limits, self.metrics = limits, metrics
        self.waiting: dict[str, dict[GatedProtocol, None]] = {}  # per address, oldest first
        self.count = 0

    def protocol(self) -> type:
        """uvicorn's h11 protocol class, gated by this gate."""
        return type("GatedH11Protocol", (GatedProtocol,), {"gate": self})

    def wait(self, conn: "GatedProtocol") -> None:
        """``conn`` now waits for a request: make room for it, then start its deadline."""
        mine = self.waiting.get(conn.address, {})
        if len(mine) >= self.limits.max_waiting_per_client:
            self.close(next(iter(mine)), "client_connections")
        elif self.count >= self.limits.max_waiting:
            self.close(next(iter(max(self.waiting.values(), key=len))), "connections")
        self.waiting.setdefault(conn.address, {})[conn] = None
        self.count += 1
        conn.arm(self.limits.header_timeout)

    def leave(self, conn: "GatedProtocol") -> None:
        """``conn`` no longer waits (its request began, or it closed)."""
        mine = self.waiting.get(conn.address)
        if mine is not None and conn in mine:
            del mine[conn]
            self.count -= 1
            if not mine:
                del self.waiting[conn.address]
        conn.disarm()

    def close(self, conn: "GatedProtocol", reason: str) -> None:
        self.leave(conn)
        self.metrics.refused(reason)
        conn.refuse(reason)


class GatedProtocol(H11Protocol):
    """uvicorn's h11 protocol, reporting to its gate when it waits for a request and when one begins."""

    gate: ConnectionGate

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = client_key(self.client[0]) if self.client else ""
        self.timer: asyncio.TimerHandle | None = None
        self.partial = False  # bytes have come since it began waiting
        self.gate.wait(self)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        self.partial = self.partial or self.timer is not None
        super().data_received(data)
        if self.cycle is not cycle:
            self.gate.leave(self)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # may start a pipelined request at once
        if self.cycle is cycle and not self.transport.is_closing():
            self.partial = False
            self.gate.wait(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.leave(self)
        super().connection_lost(exc)

    def arm(self, seconds: float) -> None:
        self.disarm()
        self.timer = self.loop.call_later(seconds, self._expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        self.timer = None
        self.gate.close(self, "header_timeout" if self.partial else "idle_timeout")

    def refuse(self, reason: str) -> None:
        """Close at once; a peer that had begun a request is told why."""
        if self.partial and not self.transport.is_closing():
            status = "408 Request Timeout" if reason == "header_timeout" else "503 Service Unavailable"
            text = {"header_timeout": "the request headers did not arrive in time",
                    "client_connections": "too many connections from your address wait for their requests",
                    "connections": "too many connections wait for their requests"}.get(reason, reason)
            body = text.encode() + b"\n"
            self.transport.write(f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        self.transport.close()
