"""Links between head and tail: what every link offers, and how a link fails.

Contract
--------
A ``Link`` carries whole binary frames in order between the two nodes of one session:

* ``send(frame)`` hands one frame over (from any thread); ``LinkClosed`` once the link is gone.
* ``recv(timeout)`` returns the next frame from the other node; ``TimeoutError`` when none came
  in time, ``PeerGone`` where the other node left (the link may see a new peer later),
  ``LinkClosed`` once the link is gone.
* ``last_arrival``: when the frame ``recv`` last returned arrived (``time.perf_counter``), or
  None before the first.
* ``closed_reason``: why the link is gone, or None while it is up; known without a ``recv``, so
  an idle head can look at it.
* ``overlaps``: whether the other node computes while this one works between a ``send`` and the
  ``recv`` of its answer (a relay link: yes; local mode's in-process link, whose tail runs inside
  ``recv``: no), which decides whether rounds in flight can pay.
* ``close()`` ends it; idempotent.

Implementations: ``link.relay.RelayLink`` (through the relay), ``link.direct.DirectLink`` and
``DirectServer`` (the head's and the listening tail's ends of a direct link, no relay between),
``link.secure.SecureLink`` (sealed end to end over another link), ``node.local_link.MemoryLink``
(the tail in this process). The
head's round driver is written against this protocol and these exceptions alone.

What keeps a relay session paired uses two more, and nothing else of the links:

* ``SessionLink``, a ``Link`` to one relay session (``RelayLink``; a direct link's ends, whose
  "session" is the connection, or the listening port's one head at a time; ``SecureLink`` passes them
  through): ``peer_present`` (the other role is connected) and ``wait_peer(timeout)``
  (``TimeoutError``, or ``LinkClosed``). The dialer (``link.dialer``, the head role) waits on
  them before it pairs.
* ``PairedLink``, a ``SessionLink`` that pairs (``SecureLink``): ``keyed`` (this pairing has
  keys), ``paired_by`` (the head's: "code" or "resume") and ``restart()`` (the tail's: forget
  this pairing and wait for the next on the same connection). The dialer reads ``paired_by``;
  the listener (``link.listener``, the tail role) restarts a pairing whose peer is no longer
  trusted, and its handlers look at ``keyed``. Torch-free.
"""

from __future__ import annotations

from typing import Protocol


class LinkClosed(Exception):
    """The link is gone; the message says why."""


class PeerGone(Exception):
    """The other node left the session (the link itself may stay usable)."""


class Link(Protocol):
    overlaps: bool

    def send(self, frame: bytes) -> None: ...

    def recv(self, timeout: float | None = None) -> bytes: ...

    @property
    def last_arrival(self) -> float | None: ...

    @property
    def closed_reason(self) -> str | None: ...

    def close(self) -> None: ...


class SessionLink(Link, Protocol):
    @property
    def peer_present(self) -> bool: ...

    def wait_peer(self, timeout: float | None = None) -> None: ...


class PairedLink(SessionLink, Protocol):
    @property
    def keyed(self) -> bool: ...

    @property
    def paired_by(self) -> str | None: ...

    def restart(self) -> None: ...
