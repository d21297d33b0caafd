"""The tail role's side of a relay session: hold the slot, serve one paired peer after another.

Contract
--------
``Listener(dial, handler, log=, poll=, greeting=, ending=, once=, pause=)`` is how a node in the relay's
tail role keeps its session: the model's tail (``node.tail``, the ``Verifier`` behind it) and the
chat host (``remote.host``) are ``Handler``s behind it. ``dial()`` opens the relay connection in
the tail's role, sealed (a ``SecureLink`` with the node's ``Passcode`` and ``ResumeFile``, which
pairs one peer after another on it) or plain (``--insecure``). ``serve()`` dials once (a failure
is the caller's to fix, and raises), then takes frames with ``link.recv(poll())`` until
``close()`` (from any thread); between frames, at least every ``poll()`` seconds, it calls
``handler.tick(link)``. It hands each frame to ``handler.take(frame, link)``; a peer that leaves
is reported (``handler.peer_gone()``) and the same connection waits for the next. Nothing a peer
sends makes it give up its relay connection (which would free the slot for someone else): an
integrity error of a paired peer (a frame altered, replayed, withheld past the handler's own
deadline: ``end_pairing``) is logged with ``ending``, told to the handler
(``handler.pairing_ended(link, exc)``, which may tell the peer) and the pairing is restarted on
the same connection. ``greeting`` (if any) is logged each time it starts waiting for a peer.

A lost relay connection is reported (``handler.link_lost()``) and dialled again with the one
backoff (``link.backoff``) for as long as the relay cannot be reached: such a node is meant to be
left running in a notebook. A relay that refuses the token (it restarted with a new one) is no
outage: after ``TOKEN_REFUSALS`` refusals in a row ``serve`` raises a ``UserError`` that says so.
``pause(delay)`` waits between two dials (by default, until ``close()`` at the latest; tests
hand in a fake clock's).
``serve`` returns 0 once closed; with ``once`` (tests) it also returns 0 after the first peer that
sent a frame left, and 1 when such a peer's pairing ended or the relay connection was lost, so
that no listener outlives its test.

``sealed(join, passcode, session, resumption, log, names)`` is the dial of a sealed listener:
``join()`` (a ``RelayLink`` in the tail's role) wrapped in a ``SecureLink`` that answers pairings
within ``passcode``'s budget and keeps its secret in ``resumption``, logging as ``names`` say.

Every line it writes (and the handler's, through ``self.log``; and a sealed dial's pairing
attempts) passes ``nodelog.limited``: the process's one rate limit, so that no peer can make the
node write more than it allows. Torch-free.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

from sfchat import UserError
from sfchat.link import LinkClosed, PeerGone, SessionLink
from sfchat.link.backoff import redial
from sfchat.link.relay import TokenRefused
from sfchat.link.pairer import Names
from sfchat.link.pairing import Passcode
from sfchat.link.resume import Resumption
from sfchat.link.secure import IntegrityError, PlaintextPeer, SecureLink
from sfchat.nodelog import limited
from sfchat.plaintext import plain

POLL_S = 1.0  # how often the listener looks whether it was closed, unless the handler asks for another
TOKEN_REFUSALS = 4  # refusals of the token in a row after which the listener stops


class Handler(Protocol):
    def take(self, frame: bytes, link) -> None: ...  # a frame from the paired peer

    def tick(self, link) -> None: ...  # between frames (keepalives, deadlines, stats)

    def peer_gone(self) -> None: ...  # the peer left the session; the next one may come

    def pairing_ended(self, link, exc: IntegrityError) -> None: ...  # before the pairing restarts

    def link_lost(self) -> None: ...  # the relay connection is gone; the listener dials again


class _Closed(Exception):
    """The listener was closed while it dialled."""


class Listener:
    def __init__(self, dial: Callable[[], SessionLink], handler: Handler, *, log: Callable[[str], None],
                 poll: Callable[[], float] = lambda: POLL_S, greeting: str | None = None,
                 ending: str = "ending this head's session", once: bool = False,
                 pause: Callable[[float], object] | None = None):
        self.dial, self.handler, self.poll = dial, handler, poll
        self.log, self.greeting, self.ending, self.once = limited(log), greeting, ending, once
        self.link = None
        self._closed = threading.Event()
        self.pause = pause or self._closed.wait  # between two dials; ``close()`` ends it

    def serve(self) -> int:
        self.link = self.dial()  # a first failure is the user's to fix
        try:
            while not self._closed.is_set():
                if self.greeting:
                    self.log(self.greeting)
                try:
                    if self._serve_link(self.link):
                        return 0
                except IntegrityError as exc:
                    served = self.link.keyed or isinstance(exc, PlaintextPeer)  # a peer got an answer
                    self.end_pairing(plain(exc), exc)
                    if self.once and served:
                        return 1
                except LinkClosed as exc:
                    self.handler.link_lost()
                    if self._closed.is_set():
                        return 0
                    if self.once:
                        self.log(f"relay connection lost: {exc}; stopping (once)")
                        return 1
                    self.log(f"relay connection lost: {exc}; dialling again")
                    self.link.close()
                    try:
                        self.link = self._redial()
                    except _Closed:
                        return 0
            return 0
        finally:
            if self.link is not None:
                self.link.close()

    def end_pairing(self, why: str, exc: IntegrityError | None = None) -> None:
        """The paired peer is no longer trusted or heard: log why, tell the handler, and let the same
        relay connection wait for a pairing again (a meddler must not free the slot)."""
        self.log(f"{why}; {self.ending}")
        self.handler.pairing_ended(self.link, exc)
        if hasattr(self.link, "restart"):  # a sealed link; a plain one (--insecure) has no pairing
            self.link.restart()

    def close(self) -> None:
        self._closed.set()
        link = self.link
        if link is not None:
            link.close()

    def _serve_link(self, link) -> bool:
        """Frames until the link fails (raises); with ``once``, True once a peer that sent one left."""
        served = False
        while not self._closed.is_set():
            self.handler.tick(link)
            try:
                frame = link.recv(timeout=self.poll())
            except TimeoutError:
                continue
            except PeerGone:
                self.handler.peer_gone()
                if self.once and served:
                    return True
                continue
            served = True
            self.handler.take(frame, link)
        return False

    def _redial(self):
        """Dial again with the one backoff until the relay answers; a relay that keeps refusing the
        token ends the listener (a UserError)."""
        refusals = 0

        def attempt(left):
            if self._closed.is_set():
                raise _Closed
            return self.dial()

        def failed(exc: BaseException, delay: float) -> None:
            nonlocal refusals
            if not isinstance(exc, TokenRefused):
                refusals = 0
                self.log(f"relay not reachable ({exc}); retrying in {delay:.1f} s")
                return
            refusals += 1
            if refusals >= TOKEN_REFUSALS:
                raise UserError(f"{exc} {refusals} times in a row: the relay runs with another token now (it "
                                "restarted?); give this node the relay's token (SFCHAT_TOKEN) and start it again") \
                    from None
            self.log(f"{exc}: the relay may have restarted with a new token; trying again in {delay:.1f} s "
                     f"({TOKEN_REFUSALS - refusals} more tries)")

        return redial(attempt, UserError, on_retry=failed, pause=self.pause)


def sealed(join: Callable[[], SessionLink], passcode: Passcode, session: str, resumption: Resumption,
           log: Callable[[str], None], names: Names = Names()) -> Callable[[], SessionLink]:
    """A dial whose links pair one peer after another, sealed end to end (see the module docstring)."""
    log = limited(log)
    return lambda: SecureLink(join(), passcode, session, "tail", log=log, resumption=resumption, names=names)
