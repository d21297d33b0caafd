"""The model head's dialer: ``link.dialer.Dialer`` with the head's settings and words.

Contract: ``HeadDialer(settings, on_event, ask_code)`` is how the head gets a tail, the first
time and after every loss: calling it (``dial(wait_timeout)``) returns what the
``link.dialer.Dialer`` it is returns (a paired ``SecureLink`` over a ``DirectLink`` to
``settings.direct``, tried first, or through ``settings.relay``; plain with ``--insecure``), or
``None`` in local mode (neither), after a ``LinkState("local")``.
The first code tried is ``settings.secret`` (``SFCHAT_CODE``, ``--secret``), then only what
``ask_code(reason)`` gives (the chat UI's runtime asks the person; the server,
``serve.generator``, hands over a code given to it with ``set_code``); the rules of codes, the
code-attempt budget and the deadlines are the dialer's. The "waiting" state says how to start a
tail on the session. Without the relay token a dial through the relay is a ``UserError``. ``connect_relay(settings,
on_event, wait_timeout)`` is one dial of a fresh dialer. Torch-free.
"""

from __future__ import annotations

import time  # noqa: F401  (tests pace the dialer's budget through this module's clock)
from typing import Callable

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import LinkState
from sfchat.link.dialer import Dialer
from sfchat.link.direct import DirectLink, address
from sfchat.link.relay import RelayLink


class HeadDialer(Dialer):
    def __init__(self, s: Settings, on_event: Callable = lambda e: None,
                 ask_code: Callable[[str], str] | None = None):
        join = direct = None
        if s.relay:
            join = lambda timeout: RelayLink(s.relay, s.token, s.session, "head", connect_timeout=timeout)  # noqa: E731
        if s.direct:
            host, port = address(s.direct)
            direct = lambda timeout: DirectLink(host, port, connect_timeout=timeout)  # noqa: E731
        super().__init__(join, s.session, s.secret, insecure=s.insecure, on_event=on_event, ask_code=ask_code,
                         where=s.relay or "", direct=direct, direct_where=s.direct or "")
        self.s = s

    def __call__(self, wait_timeout: float | None = None):
        if not self.s.relay and not self.s.direct:
            self.on_event(LinkState("local"))
            return None
        if self.s.relay and not self.s.token:
            raise UserError("--relay needs the relay token: --token T or SFCHAT_TOKEN")
        return super().__call__(wait_timeout)

    def waiting_text(self) -> str:
        s = self.s
        if not s.insecure and self.resumption.secret is not None:
            return super().waiting_text()
        then = " and --insecure" if s.insecure else ", and use the code it prints"
        return (f"waiting for a tail on session {s.session!r}: run sfchat --tail --relay {s.relay} --session "
                f"{s.session} with SFCHAT_TOKEN set{then}")


def connect_relay(s: Settings, on_event: Callable = lambda e: None, wait_timeout: float | None = None):
    """The head's relay link once a tail is present and paired (None in local mode)."""
    return HeadDialer(s, on_event)(wait_timeout)
