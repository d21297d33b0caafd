"""The head's link to its tail through the relay: dial, wait for the tail, pair.

Contract: ``connect_relay(settings, on_event, wait_timeout)`` returns the head's link once a
tail is present on the session (``None`` in local mode, after a ``LinkState("local")``): a
``RelayLink`` sealed end to end by ``SecureLink`` with the pairing code, or plain with
``--insecure``; it reports ``LinkState`` "waiting" (with the command that starts a tail) and
"connected". The round driver calls it again (``reconnect``) when a link is lost. User
mistakes (no token, no code) are ``UserError``. Torch-free.
"""

from __future__ import annotations

from typing import Callable

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import LinkState
from sfchat.link.pairing import require_secret
from sfchat.link.relay import RelayLink
from sfchat.link.secure import secure


def connect_relay(s: Settings, on_event: Callable = lambda e: None, wait_timeout: float | None = None):
    """The head's relay link once a tail is present (None in local mode), reporting LinkState."""
    if not s.relay:
        on_event(LinkState("local"))
        return None
    if not s.token:
        raise UserError("--relay needs the relay token: --token T or SFCHAT_TOKEN")
    require_secret(s.secret, s.insecure)
    link = RelayLink(s.relay, s.token, s.session, "head")
    if not link.peer_present:
        on_event(LinkState("waiting", f"waiting for a tail on session {s.session!r}: run "
                                      f"sfchat --tail --relay {s.relay} --session {s.session} with "
                                      f"SFCHAT_TOKEN set{', and use the code it prints' if s.secret else ' and --insecure'}"))
        try:
            link.wait_peer(wait_timeout)
        except BaseException:
            link.close()
            raise
    if s.secret:  # end to end: the relay forwards sealed frames it cannot read or alter
        link = secure(link, s.secret, s.session, "head")
    on_event(LinkState("connected", s.relay if s.secret else f"{s.relay} (unencrypted: --insecure)"))
    return link
