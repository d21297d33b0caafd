"""The remote chat screen against hostile input (``sfchat --offer-chat`` / ``--remote``): a chat
code too short to stand online guessing, a host log a stranger could fill, a head that streams a
reply with no end, a link that a relay stalls. Real relays on loopback where a relay takes part;
the head's runtime is scripted (``test_remote.ScriptedHead``) or hostile on purpose."""

from __future__ import annotations

import queue

import pytest

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import CodeWanted
from sfchat.link.pairing import require_secret
from sfchat.remote.cli import offer_chat
from sfchat.remote.client import RemoteRuntime

from test_remote import WAIT, ScriptedHead


def next_event(events: queue.Queue, kind: type):
    """The next event of ``kind`` the runtime reports (within WAIT: a bound, not a measurement)."""
    while True:
        event = events.get(timeout=WAIT)
        if isinstance(event, kind):
            return event


@pytest.mark.parametrize("code", ["ab", "  Ab -- c  "])
def test_a_chat_code_shorter_than_the_tails_rule_is_refused_before_the_head_starts(monkeypatch, code):
    """Round five: SFCHAT_CHAT_CODE=ab was offered as it was, and a stranger paired on the 2nd guess."""
    monkeypatch.setenv("SFCHAT_CHAT_CODE", code)
    head = ScriptedHead()
    with pytest.raises(UserError) as refused:
        offer_chat(Settings(relay="ws://127.0.0.1:9", token="t", session="mine"), None, head)
    assert head.listener is None  # the head was never started, nothing was dialled
    message = str(refused.value)
    assert message.startswith("SFCHAT_CHAT_CODE has ") and "a code must have at least 8" in message
    with pytest.raises(UserError, match="characters .* a code must have at least 8"):  # the tail's rule, one check
        require_secret(code, False, role="tail")


def test_the_chat_screen_asks_again_for_a_short_chat_code_and_says_the_rule():
    dials = []
    client = RemoteRuntime(lambda: dials.append(1), "ab", "mine-chat")
    events: queue.Queue = queue.Queue()
    client.start(events.put)
    try:
        reason = next_event(events, CodeWanted).reason
    finally:
        client.close()
    assert "the chat code has 2 characters" in reason and "at least 8" in reason
    assert dials == []  # nothing tried with a code that breaks the rule
