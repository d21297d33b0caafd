"""The tail role's side of a session: hold the relay slot (or the listening port), serve one paired peer after another.

Contract
--------
``Listener(dial, handler, log=, poll=, greeting=, ending=, once=, pause=)`` is how a node in the relay's
tail role keeps its session: the model's tail (``node.tail``, the ``Verifier`` behind it) and the
chat host (``remote.host``) are ``Handler``s behind it. ``dial()`` opens the relay connection in
the tail's role (or hands over the ``link.direct.DirectServer`` it listens on), sealed (a
``SecureLink`` with the node's ``Passcode`` and ``ResumeFile``, which pairs one peer after
another on it) or plain (``--insecure``). ``serve()`` dials once (a failure
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

A node with two places a head may reach it by (the tail with ``--relay`` and ``--listen``) serves
them as one link: given a list of dials, ``Listener`` dials each (a failure raises) into a
``Places``, which takes one paired head at a time. Each place is read in its own thread (at most
``PLACE_QUEUE`` frames ahead: the places' own bounds hold); the first place whose head sends a
frame is served until that head leaves (``PeerGone``) or its pairing ends; a head paired at the
other place meanwhile is told it is busy (``handler.pairing_ended(link, Busy)``, which tells the
peer) and its pairing restarts. A place whose connection is lost is dialled again in its thread
with the same backoff and token count (its head, if served, is a ``PeerGone`` to the handler),
while the other goes on; a relay that keeps refusing the token stops the listener as above.

``sealed(join, passcode, session, resumption, log, names)`` is the dial of a sealed listener:
``join()`` (a ``RelayLink`` in the tail's role) wrapped in a ``SecureLink`` that answers pairings
within ``passcode``'s budget and keeps its secret in ``resumption``, logging as ``names`` say.

Every line it writes (and the handler's, through ``self.log``; and a sealed dial's pairing
attempts) passes ``nodelog.limited``: the process's one rate limit, so that no peer can make the
node write more than it allows. Torch-free.
"""

from __future__ import annotations

import queue
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
PLACE_QUEUE = 4  # frames a place's reader may hold for the listener before it stops reading
PLACE_POLL_S = 0.5  # how often a place's reader looks whether the places were closed


class Handler(Protocol):
    def take(self, frame: bytes, link) -> None: ...  # a frame from the paired peer

    def tick(self, link) -> None: ...  # between frames (keepalives, deadlines, stats)

    def peer_gone(self) -> None: ...  # the peer left the session; the next one may come

    def pairing_ended(self, link, exc: IntegrityError) -> None: ...  # before the pairing restarts

    def link_lost(self) -> None: ...  # the relay connection is gone; the listener dials again


class _Closed(Exception):
    """The listener was closed while it dialled."""


class Busy(IntegrityError):
    """A head paired at one place while the head of the other is served."""


class Listener:
    def __init__(self, dial: Callable[[], SessionLink] | list[Callable[[], SessionLink]], handler: Handler, *,
                 log: Callable[[str], None],
                 poll: Callable[[], float] = lambda: POLL_S, greeting: str | None = None,
                 ending: str = "ending this head's session", once: bool = False,
                 pause: Callable[[float], object] | None = None):
        self.handler, self.poll = handler, poll
        self.dial = (lambda: self._places(dial)) if isinstance(dial, list) else dial
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

    def _places(self, dials: list[Callable[[], SessionLink]]) -> "Places":
        """The links of ``dials`` served as one, one head at a time (see the module docstring)."""
        busy = Busy("this tail serves another head now; try again when it is done")
        links: list = []
        try:
            for dial in dials:
                links.append(dial())
        except BaseException:
            for link in links:
                link.close()
            raise
        return Places(links, dials, self._redial, lambda link: self.handler.pairing_ended(link, busy), self.log)

    def _redial(self, dial: Callable[[], SessionLink] | None = None):
        """Dial again with the one backoff until the relay answers; a relay that keeps refusing the
        token ends the listener (a UserError)."""
        refusals = 0
        dial = dial or self.dial

        def attempt(left):
            if self._closed.is_set():
                raise _Closed
            return dial()

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


class Places:
    """Sealed links of one node at several places, read in threads, as one link to one head at a time."""

    def __init__(self, links: list, dials: list, redial: Callable, busy: Callable, log: Callable[[str], None]):
        self.links, self.dials, self.redial, self.busy, self.log = list(links), dials, redial, busy, log
        self.active = None  # the link whose head is served
        self.failed = None  # the link whose pairing ended, until ``restart``
        self._queue: queue.Queue = queue.Queue(PLACE_QUEUE)
        self._go = [threading.Event() for _ in links]
        self._closed = threading.Event()
        for n in range(len(links)):
            self._go[n].set()
            threading.Thread(target=self._read, args=(n,), name=f"listener-place-{n}", daemon=True).start()

    def _put(self, item) -> None:
        while not self._closed.is_set():
            try:
                return self._queue.put(item, timeout=PLACE_POLL_S)
            except queue.Full:
                continue

    def _read(self, n: int) -> None:
        while not self._closed.is_set():
            if not self._go[n].wait(PLACE_POLL_S):
                continue
            link = self.links[n]
            try:
                self._put((link, link.recv(PLACE_POLL_S)))
            except TimeoutError:
                continue
            except PeerGone as exc:
                self._put((link, exc))
            except IntegrityError as exc:
                self._go[n].clear()  # until the listener restarts this pairing
                self._put((link, exc))
            except LinkClosed as exc:
                if self._closed.is_set():
                    return
                self._put((link, PeerGone(f"lost: {exc}")))
                self.log(f"relay connection lost: {exc}; dialling again")
                link.close()
                try:
                    self.links[n] = self.redial(self.dials[n])
                except _Closed:
                    return
                except UserError as exc:
                    self._put((None, exc))  # a relay that keeps refusing the token: the listener stops
                    return

    def recv(self, timeout: float | None = None) -> bytes:
        while True:
            try:
                link, item = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no frame within {timeout:g} s") from None
            if link is None:
                raise item
            if isinstance(item, PeerGone):
                if link is self.active:
                    self.active = None
                    raise item
                continue
            if isinstance(item, IntegrityError):
                self.failed = link
                if self.active in (None, link):
                    self.active = None
                    raise item  # the listener ends this pairing (``restart``)
                self.log(f"{plain(item)}; ending the pairing of a head at another place")
                self.restart()  # the served head goes on
                continue
            if self.active is None:
                self.active = link
            if link is self.active:
                return item
            self.failed = link  # a head at the other place while one is served: told so, then re-paired
            self.log("a head at another place was told that this node serves another head now")
            self.busy(self)
            self.restart()

    def restart(self) -> None:
        link, self.failed = self.failed, None
        if link is not None:
            if hasattr(link, "restart"):  # a sealed link; a plain one (--insecure) has no pairing
                link.restart()
            if link in self.links:
                self._go[self.links.index(link)].set()

    def _now(self):
        return self.failed or self.active or self.links[0]

    @property
    def keyed(self) -> bool:
        return getattr(self._now(), "keyed", True)  # a plain link (--insecure) carries data from the start

    @property
    def inner(self):
        return self._now().inner

    def send(self, frame) -> None:
        self._now().send(frame)

    @property
    def closed_reason(self) -> str | None:
        return "the listener was closed" if self._closed.is_set() else None

    def close(self) -> None:
        self._closed.set()
        for link in self.links:
            link.close()


def sealed(join: Callable[[], SessionLink], passcode: Passcode, session: str, resumption: Resumption,
           log: Callable[[str], None], names: Names = Names()) -> Callable[[], SessionLink]:
    """A dial whose links pair one peer after another, sealed end to end (see the module docstring)."""
    log = limited(log)
    return lambda: SecureLink(join(), passcode, session, "tail", log=log, resumption=resumption, names=names)
