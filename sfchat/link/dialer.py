"""The head role's way to a paired peer, directly or through the relay: dial, wait for the peer, pair; and again.

Contract
--------
``Dialer(join, session, code, insecure=, on_event=, ask_code=, where=, direct=, direct_where=)`` is
how a node in the relay's head role gets its peer, the first time and after every loss: the model
head its tail (``node.connect.HeadDialer``), the chat screen its chat host (``remote.client``).
Calling it (``dial(wait_timeout)``) returns the link once a peer is present on the session and
paired: the relay link that ``join(connect_timeout)`` opens (a ``RelayLink`` in the head's role)
sealed end to end by ``SecureLink``, or plain with ``insecure``. With ``direct`` (a
``link.direct.DirectLink`` to a tail that listens, at ``direct_where``) every dial tries it first,
for at most ``DIRECT_WAIT_S``; when it fails (``Unreachable``) the dialer says so (``LinkState``
"waiting") and goes through the relay, or, without ``join`` (None: no relay), raises it. The
pairing, the codes and the resumption are the same either way; ``via`` says which the last dial
took ("direct" or "relay"). It reports ``LinkState`` "waiting" (with what
starts or brings back a peer, ``waiting_text()``; and while another node, ``rival``, holds the
session's head slot, retried for up to ``SLOT_WAIT_S`` through ``relay.join_while_taken``) and
"connected" (naming ``where``). Every wait of one dial (the relay's answer, the slot, the peer, the pairing)
ends by ``wait_timeout`` when one is given. ``close()`` (from any thread) closes the relay link
being dialled and makes every later dial raise ``LinkClosed``. Redialling after a failure is the
caller's, through ``link.backoff.redial`` (one backoff under one deadline).

Codes. A code is tried at most once per time it is supplied: by ``code`` for the first dial, then
only by ``ask_code(reason)`` (a person asked on a screen; a server handing over a code given to
it). Once a code attempt has been answered (it paired, or the code was wrong) the dialer forgets
the code. It keeps, in memory only, the resumption secret its code pairing left
(``resumption``), so a peer that restarted with its own copy pairs again with no code; a peer
that does not resume (restarted without its state, or a stranger in its slot) gets no code from
this dialer unless one was supplied since: without ``ask_code`` the dial fails with
``ResumptionRefused``, which says so. Code attempts also spend ``pairing.HEAD_ATTEMPTS`` (this
process's budget, per session and in total, as strict as a tail's): an attempt waits for its
turn, saying so. When the code is missing, breaks ``check(code)`` (``pairing.require_secret``
unless a subclass says otherwise) or is wrong, ``ask_code`` is asked (``reason(exc)`` words why;
``ask_text`` when no code was given at all) and the dialer tries again on a new connection;
without ``ask_code`` those are errors: ``UserError``, the link's ``WrongCode``, or ``CodeNeeded``.
Whatever ``ask_code`` raises passes through. Torch-free.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from sfchat import UserError
from sfchat.events import LinkState
from sfchat.link import LinkClosed, SessionLink, pairing
from sfchat.link.backoff import MIN_WAIT_S
from sfchat.link.direct import Unreachable
from sfchat.link.pairing import ATTEMPT_INTERVAL_S, BURST, require_secret
from sfchat.link.relay import SlotTaken, join_while_taken
from sfchat.link.resume import Resumption
from sfchat.link.secure import CodeNeeded, WrongCode, secure
from sfchat.plaintext import plain

ASK_CODE = ("the tail printed a pairing code when it started (sfchat --tail), such as 7-crossover-clockwork: "
            "type it here; the relay never sees it")
SLOT_WAIT_S = 30.0  # how long a dialer retries a session whose head slot is taken
CONNECT_WAIT_S = 30.0  # the relay's answer to a dial
PAIRING_WAIT_S = 60.0  # the peer's answers to the pairing
DIRECT_WAIT_S = 5.0  # a direct dial, before the relay is tried instead


class Dialer:
    ask_text = ASK_CODE  # what a person is asked when no code was given
    rival = "head"  # what else may hold the session's head slot

    def __init__(self, join: Callable[[float], SessionLink] | None, session: str, code: str | None = None, *,
                 insecure: bool = False, on_event: Callable = lambda e: None,
                 ask_code: Callable[[str], str] | None = None, where: str = "",
                 direct: Callable[[float], SessionLink] | None = None, direct_where: str = ""):
        self.join, self.session, self.insecure, self.where = join, session, insecure, where
        self.direct, self.direct_where = direct, direct_where
        self.via = "direct" if join is None else "relay"
        self.on_event, self.ask_code = on_event, ask_code
        self.code = code  # supplied and not yet answered; None once it has been
        self.tried = False  # a code attempt of this dialer has been answered
        self.resumption = Resumption()  # left by its code pairing; a node restarted has none
        self._lock = threading.Lock()
        self._dialling = None  # the relay link of the dial in progress
        self._closed = False

    def __call__(self, wait_timeout: float | None = None):
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        if self.insecure:
            link = self._join(deadline)
            self.on_event(LinkState("connected", f"{self._where()} (unencrypted: --insecure)"))
            return link
        if self.code is None and self.resumption.secret is None and self.tried:
            self._need(CodeNeeded(f"the pairing code this head was given has been tried on session {self.session!r} "
                                  "and did not pair; it tries a code once per time it is given one: give it the "
                                  "code the tail printed"))
        else:
            self._check_code()
        while True:
            turn = self.code is not None and self._turn(deadline)
            try:  # end to end: the relay forwards sealed frames it cannot read or alter
                link = secure(self._join(deadline), self.code, self.session, "head",
                              timeout=self._left(deadline, PAIRING_WAIT_S), resumption=self.resumption)
            except WrongCode as exc:
                self.code, self.tried = None, True  # a guess was tested: its turn stays spent
                self._need(exc)
                continue
            except CodeNeeded as exc:
                self._give_back(turn)
                self._need(exc)
                continue
            except BaseException:
                self._give_back(turn)
                raise
            self._give_back(turn)  # a code that pairs is no guess; a resumption tested none
            if link.paired_by == "code":
                self.code, self.tried = None, True
            self.on_event(LinkState("connected", self._where()))
            return link

    def close(self) -> None:
        """Close the relay link being dialled; every later dial raises ``LinkClosed``."""
        with self._lock:
            self._closed, link = True, self._dialling
        if link is not None:
            link.close()

    # -- what a user of the dialer may word otherwise ------------------------------------------------
    def check(self, code: str | None) -> None:
        """A ``UserError`` for a code that may not be tried."""
        require_secret(code, False)

    def reason(self, exc: Exception) -> str:
        """Why a person is asked for a code, after ``exc`` (a wrong code, a refused resumption ...)."""
        return plain(exc)

    def waiting_text(self) -> str:
        if self.resumption.secret is not None:
            return (f"waiting for the tail of session {self.session!r} to come back: a tail restarted with its "
                    "state resumes this pairing by itself, no code needed")
        return f"waiting for a tail on session {self.session!r}"

    # -- codes -------------------------------------------------------------------------------------
    def _need(self, exc: Exception) -> None:
        """A code is needed (``exc`` says why): ``ask_code`` gives one, else ``exc`` is raised."""
        if self.ask_code is None:
            raise exc
        self.code = self.ask_code(self.reason(exc))
        self._check_code()

    def _check_code(self) -> None:
        """The code passes ``check`` (none is needed while a resumption secret is held), or
        ``ask_code`` is asked until one does."""
        while True:
            if self.code is None and self.resumption.secret is not None:
                return
            try:
                self.check(self.code)
                return
            except UserError as exc:
                if self.ask_code is None:
                    raise
                # a person at a screen is asked in the screen's words, not the command line's
                self.code = self.ask_code(self.ask_text if not self.code else plain(exc))

    def _turn(self, deadline: float | None) -> bool:
        """Wait for this process's budget to allow a code attempt, then take the turn."""
        wait = pairing.HEAD_ATTEMPTS.wait(self.session)
        if wait > 0:
            if deadline is not None and time.monotonic() + wait > deadline:
                raise TimeoutError(f"the next pairing code attempt is allowed in {wait:.1f} s, past the wait left")
            self.on_event(LinkState("waiting", f"pairing code attempts are limited to {BURST} at once, then one per "
                                               f"{ATTEMPT_INTERVAL_S:g} s: the next in {wait:.1f} s"))
            time.sleep(wait)
        pairing.HEAD_ATTEMPTS.spend(self.session)
        return True

    def _give_back(self, turn: bool) -> None:
        if turn:
            pairing.HEAD_ATTEMPTS.give_back(self.session)

    # -- the relay ----------------------------------------------------------------------------------
    @staticmethod
    def _left(deadline: float | None, most: float) -> float:
        """What a wait of at most ``most`` seconds may take before ``deadline``."""
        if deadline is None:
            return most
        return max(min(most, deadline - time.monotonic()), MIN_WAIT_S)

    def _where(self) -> str:
        return f"{self.direct_where} (direct)" if self.via == "direct" else self.where

    def _join(self, deadline: float | None):
        """A direct connection to the tail, or else a relay connection in the head's role once a peer is there."""
        if self.direct is not None:
            self._check_open()
            try:
                link = self.direct(self._left(deadline, DIRECT_WAIT_S))
            except Unreachable as exc:
                if self.join is None:
                    raise
                self.on_event(LinkState("waiting", f"{exc}; through the relay instead"))
            else:
                self.via = "direct"
                return self._hold(link)
        self.via = "relay"
        return self._join_relay(deadline)

    def _hold(self, link):
        """``link`` is the one being dialled (``close()`` closes it), unless the dialer was closed."""
        with self._lock:
            self._dialling = link
        try:
            self._check_open()
        except BaseException:
            link.close()
            raise
        return link

    def _join_relay(self, deadline: float | None):
        """A relay connection in the head's role, once a peer is there."""

        def taken(exc: SlotTaken) -> None:
            self.on_event(LinkState("waiting", f"{exc}: trying again (another {self.rival} of yours, or someone "
                                               "else holding the relay token)"))

        def join():
            self._check_open()
            return self.join(self._left(deadline, CONNECT_WAIT_S))

        try:
            link = join_while_taken(join, self._left(deadline, SLOT_WAIT_S), taken)
        except SlotTaken as exc:
            raise UserError(f"{exc} for {SLOT_WAIT_S:.0f} s: is another {self.rival} running on session "
                            f"{self.session!r}? (or pick another --session)") from None
        self._hold(link)
        try:
            if not link.peer_present:
                self.on_event(LinkState("waiting", self.waiting_text()))
                link.wait_peer(None if deadline is None else self._left(deadline, deadline - time.monotonic()))
        except BaseException:
            link.close()
            raise
        return link

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise LinkClosed("the dialer was closed")
