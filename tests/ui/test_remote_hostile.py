"""The remote chat screen against hostile input (``sfchat --offer-chat`` / ``--remote``): a chat
code too short to stand online guessing, a host log a stranger could fill, a head that streams a
reply with no end, a link that a relay stalls. Real relays on loopback where a relay takes part;
the head's runtime is scripted (``test_remote.ScriptedHead``) or hostile on purpose."""

from __future__ import annotations

import queue
import threading

import pytest

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import CodeWanted
from sfchat.link.pairing import require_secret
from sfchat.remote.cli import offer_chat
from sfchat.remote.client import RemoteRuntime

from test_remote import WAIT, ScriptedHead, until


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


class OwnedHead(ScriptedHead):
    """A scripted head that keeps the chat host serving it (its listener's owner), to close it."""

    def start(self, listener) -> None:
        self.host = listener.__self__
        super().start(listener)


def test_a_stranger_joining_the_chat_slot_in_a_loop_cannot_fill_the_hosts_log(relay_url, monkeypatch, capsys):
    """Round five: a token holder joining and leaving ``<session>-chat`` wrote 9,076 lines in 20 s.
    The chat host's log passes the process's one limit (``sfchat.nodelog``), the tail's too."""
    from sfchat import nodelog
    from sfchat.link.relay import RelayLink
    from sfchat.node import tail

    from relay_process import TOKEN

    frozen = nodelog.LogLimit(per_s=100, burst=1500, clock=lambda: 0.0)  # no refill: what is written is the burst
    monkeypatch.setattr(nodelog, "LIMIT", frozen)
    monkeypatch.delenv("SFCHAT_CHAT_CODE", raising=False)
    head = OwnedHead()
    served = []
    thread = threading.Thread(target=lambda: served.append(
        offer_chat(Settings(relay=relay_url, token=TOKEN, session="mine"), None, head)), daemon=True)
    thread.start()
    assert until(lambda: getattr(head, "host", None) is not None and head.host.link is not None)
    for _ in range(60):  # a stranger in the chat screen's slot, joining and leaving
        RelayLink(relay_url, TOKEN, "mine-chat", "head").close()
    assert until(lambda: frozen.left_out >= 20), "the host never said the stranger left"
    tail.log("a line of the tail's log in the same process")
    head.host.close()
    thread.join(WAIT)
    written = capsys.readouterr().err
    assert served == [0]
    assert "chat code: " in written  # the first lines are written...
    assert len(written) <= 1500 + written.count("\n")  # ...and no more than the burst, whoever caused them
    assert "the tail's log" not in written  # one limit for the process, not one per node
