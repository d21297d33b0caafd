"""The head's link to its tail through the relay: dial, wait for the tail, pair; and again.

Contract: ``HeadDialer(settings, on_event, ask_code)`` is how the head gets a tail, the first
time and after every loss: calling it (``dial(wait_timeout)``) returns the head's link once a
tail is present on the session and paired (``None`` in local mode, after a ``LinkState("local")``):
a ``RelayLink`` sealed end to end by ``SecureLink``, or plain with ``--insecure``; it reports
``LinkState`` "waiting" (with the command that starts a tail, and while another head holds the
session's head slot, retried for up to ``SLOT_WAIT_S``) and "connected". The dialer keeps, in
memory only, the resumption secret that its first code pairing left, so that a restarted tail
that kept its own copy pairs again without a code; the round driver is handed the same dialer
to reconnect with. When the code is missing, too short or wrong, ``ask_code(reason)`` (the chat
UI's runtime: it asks the person) gives another, and the dialer tries again on a new connection;
without ``ask_code`` those are errors: ``UserError``, or the link's ``WrongCode``. Whatever
``ask_code`` raises passes through. ``connect_relay(settings, on_event, wait_timeout)`` is one
dial of a fresh dialer. Torch-free.
"""

from __future__ import annotations

import random
import time
from typing import Callable

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import LinkState
from sfchat.link.pairing import require_secret
from sfchat.link.relay import RelayLink, SlotTaken
from sfchat.link.resume import Resumption
from sfchat.link.secure import WrongCode, secure
from sfchat.plaintext import plain

ASK_CODE = ("the tail printed a pairing code when it started (sfchat --tail), such as 7-crossover-clockwork: "
            "type it here; the relay never sees it")
SLOT_WAIT_S = 30.0  # how long a head retries a session whose head slot is taken
SLOT_RETRY_S = (0.1, 0.3)  # seconds between two tries, drawn afresh each time


class HeadDialer:
    def __init__(self, s: Settings, on_event: Callable = lambda e: None,
                 ask_code: Callable[[str], str] | None = None):
        self.s, self.on_event, self.ask_code = s, on_event, ask_code
        self.code = s.secret
        self.resumption = Resumption()  # left by the first code pairing; a head restarted has none

    def __call__(self, wait_timeout: float | None = None):
        s = self.s
        if not s.relay:
            self.on_event(LinkState("local"))
            return None
        if not s.token:
            raise UserError("--relay needs the relay token: --token T or SFCHAT_TOKEN")
        self._check_code()
        while True:
            link = self._join(wait_timeout)
            if s.insecure:
                self.on_event(LinkState("connected", f"{s.relay} (unencrypted: --insecure)"))
                return link
            try:  # end to end: the relay forwards sealed frames it cannot read or alter
                link = secure(link, self.code, s.session, "head", resumption=self.resumption)
            except WrongCode as exc:
                if self.ask_code is None:
                    raise
                self.code = self.ask_code(plain(exc))
                self._check_code()
                continue
            self.on_event(LinkState("connected", s.relay))
            return link

    def _check_code(self) -> None:
        """The code obeys ``require_secret``, or ``ask_code`` is asked until one does."""
        while True:
            try:
                require_secret(self.code, self.s.insecure)
                return
            except UserError as exc:
                if self.ask_code is None or self.s.insecure:
                    raise
                # a person at a screen is asked in the screen's words, not the command line's
                self.code = self.ask_code(ASK_CODE if not self.code else plain(exc))

    def _join(self, wait_timeout: float | None) -> RelayLink:
        """A relay connection as the session's head, once a tail is there."""
        s = self.s
        deadline, told = time.monotonic() + SLOT_WAIT_S, False
        while True:
            try:
                link = RelayLink(s.relay, s.token, s.session, "head")
                break
            except SlotTaken as exc:
                if time.monotonic() >= deadline:
                    raise UserError(f"{exc} for {SLOT_WAIT_S:.0f} s: is another head running on session "
                                    f"{s.session!r}? (or pick another --session)") from None
                if not told:
                    self.on_event(LinkState("waiting", f"{exc}: trying again (another head of yours, or "
                                                       "someone else holding the relay token)"))
                    told = True
                time.sleep(random.uniform(*SLOT_RETRY_S))  # often: a slot freed for a moment is taken at once
        if not link.peer_present:
            then = " and --insecure" if s.insecure else ", and use the code it prints"
            self.on_event(LinkState("waiting", f"waiting for a tail on session {s.session!r}: run "
                                               f"sfchat --tail --relay {s.relay} --session {s.session} with "
                                               f"SFCHAT_TOKEN set{then}"))
            try:
                link.wait_peer(wait_timeout)
            except BaseException:
                link.close()
                raise
        return link


def connect_relay(s: Settings, on_event: Callable = lambda e: None, wait_timeout: float | None = None):
    """The head's relay link once a tail is present and paired (None in local mode)."""
    return HeadDialer(s, on_event)(wait_timeout)
