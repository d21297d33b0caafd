"""One byte budget for everything the relay holds in memory on behalf of its clients.

Contract
--------
A *holder* is anything that keeps client bytes alive: a receiver's outbox (``relay.session.Peer``:
frames queued for it, and the frame being written to its socket) or a connection's inbound side
(``relay.gate.MeteredConnection``: a frame still arriving, or a message received but not yet
handled). Every holder tells the ``Budget`` how many bytes it holds (``charge``, ``release``)
and can be told to give them up (``shed``).

When the bytes held by all holders together exceed the limit, holders are shed until the bytes
that are not already on their way out fit again: each time the largest holder of the *client*
(``Holder.client``: a remote address, see ``relay.gate.client_key``) whose holders hold the most
in all, so a client with many middling holders goes before one with a single large frame. Shedding
closes the holder's connection; an outbox frees its queue at once, a connection frees its bytes
when its socket is gone (a few loop iterations). A shed outbox may keep its last frame while a
polite close (code and reason) waits for the socket to drain; such *lingering* bytes are allowed
up to ``linger`` in all (``shed`` is told the room left), past which holders are shed hard
(their sockets aborted at once).
So the bytes counted stay under ``limit + linger``, plus what a single read or message added
before its holder was shed and what aborted sockets free in the next loop iterations.

``TokenBucket`` is the rate limiter the relay uses per connection.

This module knows nothing of websockets, sessions or options.
"""

from __future__ import annotations

import time
from typing import Protocol


class Holder(Protocol):
    client: str  # who the bytes are held for: the remote address (IPv6: its /64)

    @property
    def held(self) -> int: ...  # bytes this holder keeps alive now

    @property
    def shedding(self) -> bool: ...  # shed already: its bytes are on their way out

    def shed(self, linger_room: int) -> None: ...  # close it, keeping at most linger_room bytes while it closes


class Budget:
    """Bytes held by all holders together, against one limit for the whole relay."""

    def __init__(self, limit: int, linger: int = 0):
        self.limit, self.linger = limit, linger
        self.used = 0
        self.holders: set[Holder] = set()

    def charge(self, holder: Holder, size: int) -> bool:
        """``holder`` now holds ``size`` more bytes (already added to its ``held``). Shed the
        largest holders while the total is over the limit; False when ``holder`` itself was shed."""
        self.used += size
        while self.used > self.limit:
            leaving = self.leaving()
            if self.used - leaving <= self.limit:
                break
            victim = self._largest()
            if victim is None or victim.held == 0:
                break
            victim.shed(self.linger - leaving)
        return not holder.shedding

    def _largest(self) -> Holder | None:
        """The largest holder not yet shed of the client holding the most bytes."""
        by_client: dict[str, list[Holder]] = {}
        for h in self.holders:
            if not h.shedding:
                by_client.setdefault(h.client, []).append(h)
        if not by_client:
            return None
        heaviest = max(by_client.values(), key=lambda group: sum(h.held for h in group))
        return max(heaviest, key=lambda h: h.held)

    def leaving(self) -> int:
        """Bytes of holders already shed, still counted until their sockets let go."""
        return sum(h.held for h in self.holders if h.shedding)

    def release(self, size: int) -> None:
        self.used -= size


class TokenBucket:
    """``rate`` units per second with room for ``burst``; ``take`` says whether ``n`` still fit."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.level, self.stamp = burst, time.monotonic()

    def take(self, n: float) -> bool:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if n > self.level:
            return False
        self.level -= n
        return True
