"""The head's link to its tail through the relay: dial, wait for the tail, pair; and again.

Contract: ``HeadDialer(settings, on_event, ask_code)`` is how the head gets a tail, the first
time and after every loss: calling it (``dial(wait_timeout)``) returns the head's link once a
tail is present on the session and paired (``None`` in local mode, after a ``LinkState("local")``):
a ``RelayLink`` sealed end to end by ``SecureLink``, or plain with ``--insecure``; it reports
``LinkState`` "waiting" (with what starts or brings back a tail, and while another head holds the
session's head slot, retried for up to ``SLOT_WAIT_S``) and "connected". Every wait of one dial
(the relay's answer, the slot, the tail, the pairing) ends by ``wait_timeout`` when one is given.

Codes. A code is tried at most once per time it is supplied: by the setting (``SFCHAT_CODE``,
``--secret``) for the first dial, then only by ``ask_code(reason)`` (the chat UI's runtime asks
the person; the server, ``serve.generator``, hands over a code given to it with ``set_code``).
Once a code attempt has been answered (it paired, or the code was wrong) the dialer forgets the
code. The dialer keeps, in memory only, the resumption secret that its code pairing left, so a
tail that restarted with its own copy pairs again with no code; a tail that does not resume
(restarted without its state, or a stranger in its slot) gets no code from this head unless one
was supplied since: without ``ask_code`` the dial fails with ``ResumptionRefused``, which says
so. Code attempts also spend ``pairing.HEAD_ATTEMPTS`` (this process's budget, per session and
in total, as strict as a tail's): an attempt waits for its turn, saying so. When the code is
missing, too short or wrong, ``ask_code`` gives another and the dialer tries again on a new
connection; without ``ask_code`` those are errors: ``UserError``, the link's ``WrongCode``, or
``CodeNeeded``. Whatever ``ask_code`` raises passes through. ``connect_relay(settings, on_event,
wait_timeout)`` is one dial of a fresh dialer. Torch-free.
"""

from __future__ import annotations

import time
from typing import Callable

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import LinkState
from sfchat.link import pairing
from sfchat.link.pairing import ATTEMPT_INTERVAL_S, BURST, require_secret
from sfchat.link.relay import RelayLink, SlotTaken, join_while_taken
from sfchat.link.resume import Resumption
from sfchat.link.secure import CodeNeeded, WrongCode, secure
from sfchat.plaintext import plain

ASK_CODE = ("the tail printed a pairing code when it started (sfchat --tail), such as 7-crossover-clockwork: "
            "type it here; the relay never sees it")
SLOT_WAIT_S = 30.0  # how long a head retries a session whose head slot is taken
CONNECT_WAIT_S = 30.0  # the relay's answer to a dial
PAIRING_WAIT_S = 60.0  # the tail's answers to the pairing
MIN_WAIT_S = 1.0  # the least any wait of a dial is given


class HeadDialer:
    def __init__(self, s: Settings, on_event: Callable = lambda e: None,
                 ask_code: Callable[[str], str] | None = None):
        self.s, self.on_event, self.ask_code = s, on_event, ask_code
        self.code = s.secret  # supplied and not yet answered; None once it has been
        self.tried = False  # a code attempt of this dialer has been answered
        self.resumption = Resumption()  # left by its code pairing; a head restarted has none

    def __call__(self, wait_timeout: float | None = None):
        s = self.s
        if not s.relay:
            self.on_event(LinkState("local"))
            return None
        if not s.token:
            raise UserError("--relay needs the relay token: --token T or SFCHAT_TOKEN")
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        if s.insecure:
            link = self._join(deadline)
            self.on_event(LinkState("connected", f"{s.relay} (unencrypted: --insecure)"))
            return link
        if self.code is None and self.resumption.secret is None and self.tried:
            self._need(CodeNeeded(f"the pairing code this head was given has been tried on session {s.session!r} "
                                  "and did not pair; it tries a code once per time it is given one: give it the "
                                  "code the tail printed"))
        else:
            self._check_code()
        while True:
            turn = self.code is not None and self._turn(deadline)
            try:  # end to end: the relay forwards sealed frames it cannot read or alter
                link = secure(self._join(deadline), self.code, s.session, "head",
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
            self.on_event(LinkState("connected", s.relay))
            return link

    # -- codes -------------------------------------------------------------------------------------
    def _need(self, exc: Exception) -> None:
        """A code is needed (``exc`` says why): ``ask_code`` gives one, else ``exc`` is raised."""
        if self.ask_code is None:
            raise exc
        self.code = self.ask_code(plain(exc))
        self._check_code()

    def _check_code(self) -> None:
        """The code obeys ``require_secret`` (none is needed while a resumption secret is held),
        or ``ask_code`` is asked until one does."""
        while True:
            if self.code is None and self.resumption.secret is not None:
                return
            try:
                require_secret(self.code, self.s.insecure)
                return
            except UserError as exc:
                if self.ask_code is None or self.s.insecure:
                    raise
                # a person at a screen is asked in the screen's words, not the command line's
                self.code = self.ask_code(ASK_CODE if not self.code else plain(exc))

    def _turn(self, deadline: float | None) -> bool:
        """Wait for this process's budget to allow a code attempt, then take the turn."""
        session = self.s.session
        wait = pairing.HEAD_ATTEMPTS.wait(session)
        if wait > 0:
            if deadline is not None and time.monotonic() + wait > deadline:
                raise TimeoutError(f"the next pairing code attempt is allowed in {wait:.1f} s, past the wait left")
            self.on_event(LinkState("waiting", f"pairing code attempts are limited to {BURST} at once, then one per "
                                               f"{ATTEMPT_INTERVAL_S:g} s: the next in {wait:.1f} s"))
            time.sleep(wait)
        pairing.HEAD_ATTEMPTS.spend(session)
        return True

    def _give_back(self, turn: bool) -> None:
        if turn:
            pairing.HEAD_ATTEMPTS.give_back(self.s.session)

    # -- the relay ----------------------------------------------------------------------------------
    @staticmethod
    def _left(deadline: float | None, most: float) -> float:
        """What a wait of at most ``most`` seconds may take before ``deadline``."""
        if deadline is None:
            return most
        return max(min(most, deadline - time.monotonic()), MIN_WAIT_S)

    def _join(self, deadline: float | None) -> RelayLink:
        """A relay connection as the session's head, once a tail is there."""
        s = self.s

        def taken(exc: SlotTaken) -> None:
            self.on_event(LinkState("waiting", f"{exc}: trying again (another head of yours, or someone else "
                                               "holding the relay token)"))

        try:
            link = join_while_taken(lambda: RelayLink(s.relay, s.token, s.session, "head",
                                                      connect_timeout=self._left(deadline, CONNECT_WAIT_S)),
                                    self._left(deadline, SLOT_WAIT_S), taken)
        except SlotTaken as exc:
            raise UserError(f"{exc} for {SLOT_WAIT_S:.0f} s: is another head running on session {s.session!r}? "
                            "(or pick another --session)") from None
        if not link.peer_present:
            self.on_event(LinkState("waiting", self._waiting()))
            try:
                link.wait_peer(None if deadline is None else self._left(deadline, deadline - time.monotonic()))
            except BaseException:
                link.close()
                raise
        return link

    def _waiting(self) -> str:
        s = self.s
        if not s.insecure and self.resumption.secret is not None:
            return (f"waiting for the tail of session {s.session!r} to come back: a tail restarted with its state "
                    "resumes this pairing by itself, no code needed")
        then = " and --insecure" if s.insecure else ", and use the code it prints"
        return (f"waiting for a tail on session {s.session!r}: run sfchat --tail --relay {s.relay} --session "
                f"{s.session} with SFCHAT_TOKEN set{then}")


def connect_relay(s: Settings, on_event: Callable = lambda e: None, wait_timeout: float | None = None):
    """The head's relay link once a tail is present and paired (None in local mode)."""
    return HeadDialer(s, on_event)(wait_timeout)
