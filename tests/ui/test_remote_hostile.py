"""The remote chat screen against hostile input (``sfchat --offer-chat`` / ``--remote``): a chat
code too short to stand online guessing, a host log a stranger could fill, a head that streams a
reply with no end, a link that a relay stalls. Real relays on loopback where a relay takes part;
the head's runtime is scripted (``test_remote.ScriptedHead``) or hostile on purpose."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import pytest

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import (
    CodeWanted, LinkState, ReplyFinished, ReplyStarted, RoundStats, RuntimeFailed, RuntimeReady, TokensCommitted,
)
from sfchat.link.pairing import require_secret
from sfchat.params import Ask
from sfchat.plaintext import plain
from sfchat.remote.cli import offer_chat
from sfchat.protocol import chat, chat_events
from sfchat.remote.client import CHARS_PER_TOKEN, RemoteRuntime
from sfchat.tally import Tally
from sfchat.ui import SfchatApp
from sfchat.ui.metrics import MetricsPanel
from sfchat.ui.screens import ConfirmScreen

from remote_pair import WAIT, ScriptedHead, make_pair, until
from pilots import READY, FakeRuntime, chat_app, pilot_test, screen_lines, send, wait_for


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


class EndlessHead(ScriptedHead):
    """A hostile head: every reply is round after round of ``text`` and ``ids`` until cancelled,
    at most ``ROUNDS`` (on a client that never says stop, the test ends anyway). Each round waits
    until the client has reported the one before or the head was cancelled (``delivered``: the
    rounds the client reported), so that a cancel meets the reply in progress, whatever the speed."""

    ROUNDS = 120

    def __init__(self, text: str, ids: tuple[int, ...]):
        super().__init__()
        self.text, self.ids = text, ids
        self.delivered = lambda: 0

    def _generate(self) -> None:
        self.listener(ReplyStarted(prompt_tokens=4, reused_tokens=0, prefill_tokens=4))
        tally = Tally(4)
        for i in range(self.ROUNDS):
            stats = RoundStats(accepted=0, committed=len(self.ids), draft_ms=1.0, head_ms=1.0, tail_ms=1.0,
                               rtt_ms=1.0, round_ms=1.0)
            self.listener(TokensCommitted(self.text, self.ids, stats, 0.01 * (i + 1)))
            tally.add(stats, 0.01 * (i + 1))
            if not until(lambda: self._cancelled or self.delivered() > i) or self._cancelled:
                break
        self.listener(ReplyFinished("cancelled" if self._cancelled else "length", "", (), 4, **tally.figures()))
        self.finished.set()


@pytest.mark.parametrize("text, ids", [("x" * chat_events.MAX_CHUNK_CHARS, (7,)), ("y", tuple(range(1000)))],
                         ids=["characters", "tokens"])
def test_a_reply_past_what_was_asked_is_cut_said_and_stopped(relay_url, text, ids):
    """Round five: a head answering a 16-token request with 64 Ki-character rounds made the client
    hold 43.8 M characters."""
    head = EndlessHead(text, ids)
    host, _, client, _, _ = make_pair(relay_url, head)
    ready = threading.Event()
    client.start(lambda e: ready.set() if isinstance(e, RuntimeReady) else None)
    head.delivered = lambda: sum(isinstance(e, TokensCommitted) for e in client.events)
    try:
        assert ready.wait(WAIT)
        client.submit([{"role": "user", "content": "sixteen tokens, please"}], Ask(16))
        assert until(lambda: any(isinstance(e, (RuntimeFailed, ReplyFinished)) for e in client.events))
        assert until(head.finished.is_set)
        rounds = [e for e in client.events if isinstance(e, TokensCommitted)]
        ended = [e for e in client.events if isinstance(e, (RuntimeFailed, ReplyFinished))]
        assert sum(len(e.token_ids) for e in rounds) <= 16
        assert sum(len(e.text) for e in rounds) <= 16 * CHARS_PER_TOKEN
        assert len(ended) == 1 and isinstance(ended[0], RuntimeFailed) and not ended[0].fatal
        assert "more than this screen asked for (16 tokens" in ended[0].message
        assert head.cancels == 1  # the head was told to stop
        assert client._replies == {}  # and nothing of that reply is held any more
    finally:
        client.close()
        host.close()


BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"


class MirroredHead(ScriptedHead):
    """A head whose model name and link detail carry bidirectional overrides."""

    def _load(self) -> None:
        self.listener(LinkState("connected", f"ws://relay\u202e{BIDI}moc.elpmaxe"))
        self.listener(dataclasses.replace(READY, model=f"Qwen/evil\u202egpt{BIDI}.exe", draft=f"\u2067d{BIDI}raft"))


@pilot_test
async def test_the_header_shows_the_heads_one_line_texts_without_bidirectional_overrides(relay_url, tmp_path):
    """Round five: U+202E and friends survived in the model name and link detail of the header."""
    head = MirroredHead()
    host, _, client, _, _ = make_pair(relay_url, head)
    async with chat_app(client, tmp_path / "home.sqlite3", size=(160, 30), wait=WAIT) as (app, pilot):
        await pilot.pause()
        header = screen_lines(app)[0]
        link = app.query_one(MetricsPanel)._link.plain
    host.close()
    assert "evilgpt.exe" in header and "draft" in header
    assert "moc.elpmaxe" in link
    assert not set(BIDI) & set(header + link + app.ready.model + app.ready.draft)
    assert plain(f"a{BIDI}b") == "ab" and plain("مرحبا") == "مرحبا"  # the letters of a right-to-left script stay


LINKS = "See [the manual](ssh://attacker.example/x) or [this](smb://attacker.example/share).\n\n[Docs](https://example.com/a?b=1)"


async def click_text(pilot, text: str) -> None:
    """A click on the first place the screen shows ``text``."""
    for y, line in enumerate(screen_lines(pilot.app)):
        if text in line:
            await pilot.click(offset=(line.index(text) + 1, y))
            await pilot.pause()
            return
    raise AssertionError(f"{text!r} is not on the screen")


@pilot_test
async def test_a_link_in_a_reply_opens_only_over_http_and_only_after_its_target_was_shown(tmp_path):
    """Round five: a click on a reply's link opened any scheme markdown lets through (ssh:, smb:)
    at once, and the link's text may say anything."""
    app = SfchatApp(FakeRuntime(reply=LINKS), tmp_path / "links.sqlite3")
    opened: list[str] = []
    app.open_url = lambda url, **kwargs: opened.append(url)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
        await send(pilot, "links, please")
        await wait_for(pilot, lambda: not app.session.replying)
        await pilot.pause()
        for text, target in (("the manual", "ssh://attacker.example/x"), ("this", "smb://attacker.example/share")):
            await click_text(pilot, text)
            assert not isinstance(app.screen, ConfirmScreen)
            assert any(target in n.message and "Not opened" in n.message for n in app._notifications)
        await click_text(pilot, "Docs")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "https://example.com/a?b=1" in app.screen.question  # the target, whatever the text says
        await pilot.press("n")
        await click_text(pilot, "Docs")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await pilot.pause()
    assert opened == ["https://example.com/a?b=1"]


def test_the_chat_hosts_log_names_the_chat_screen_where_it_pairs_with_it(relay_url, monkeypatch, capsys):
    """Issue 45, 2.2: the --offer-chat head's log said 'paired with a head' and 'this tail's
    confirmation' of the chat screen."""
    from relay_process import TOKEN
    from sfchat.link.relay import RelayLink

    monkeypatch.setenv("SFCHAT_CHAT_CODE", "4-crossover-clockwork")
    head = OwnedHead()
    thread = threading.Thread(target=offer_chat, args=(Settings(relay=relay_url, token=TOKEN, session="mine"),
                                                       None, head), daemon=True)
    thread.start()
    client = RemoteRuntime(lambda: RelayLink(relay_url, TOKEN, "mine-chat", "head"), "4-wrong-code-here", "mine-chat")
    events: queue.Queue = queue.Queue()
    client.start(events.put)
    try:
        assert "wrong chat code" in next_event(events, CodeWanted).reason
        client.set_code("4-crossover-clockwork")
        next_event(events, RuntimeReady)
    finally:
        client.close()
        if getattr(head, "host", None) is not None:
            head.host.close()
        thread.join(WAIT)
    said = capsys.readouterr().err
    assert "the chat screen did not accept this head's confirmation: a wrong code" in said
    assert "paired with the chat screen on session 'mine-chat'" in said
    assert "a head" not in said and "this tail" not in said


def test_a_stranger_in_the_chat_sessions_slot_is_named_and_waited_out(relay_url, monkeypatch):
    """Round five: a token holder who took ``<session>-chat`` first stopped --offer-chat at once."""
    from relay_process import TOKEN
    from sfchat.link.relay import RelayLink
    from sfchat.remote import cli

    said: list[str] = []
    monkeypatch.setattr(cli, "log", said.append)
    monkeypatch.delenv("SFCHAT_CHAT_CODE", raising=False)
    squatter = RelayLink(relay_url, TOKEN, "mine-chat", "tail")
    head = OwnedHead()
    thread = threading.Thread(target=offer_chat, args=(Settings(relay=relay_url, token=TOKEN, session="mine"),
                                                       None, head), daemon=True)
    thread.start()
    try:
        assert until(lambda: any("holds the slot of chat session 'mine-chat'" in line for line in said)), said
        assert any("--chat-session NAME" in line for line in said)
        squatter.close()  # the slot comes free within the host's wait: it takes it
        assert until(lambda: getattr(head, "host", None) is not None and head.host.link is not None)
    finally:
        squatter.close()
        if getattr(head, "host", None) is not None:
            head.host.close()
        thread.join(WAIT)


def test_a_stranger_who_keeps_the_chat_sessions_slot_ends_the_wait_with_the_way_out(relay_url, monkeypatch):
    from relay_process import TOKEN
    from sfchat.link.relay import RelayLink
    from sfchat.remote import cli

    monkeypatch.setattr(cli, "SLOT_WAIT_S", 1.0)  # the wait itself is the other test's
    monkeypatch.delenv("SFCHAT_CHAT_CODE", raising=False)
    squatter = RelayLink(relay_url, TOKEN, "mine-chat", "tail")
    try:
        with pytest.raises(UserError, match="someone else holds the slot of chat session 'mine-chat'") as refused:
            offer_chat(Settings(relay=relay_url, token=TOKEN, session="mine"), None, ScriptedHead())
    finally:
        squatter.close()
    assert "--chat-session NAME" in str(refused.value) and f"--remote --relay {relay_url} --session NAME" in str(refused.value)


class Meddler:
    """The relay's hand on the frames the chat host receives: ``withhold`` drops them, ``replay``
    delivers the next one twice."""

    def __init__(self, inner) -> None:
        self.recv_inner, self.withhold, self.replay, self.again = inner.recv, False, False, None
        inner.recv = self.recv

    def recv(self, timeout=None):
        if self.again is not None:
            frame, self.again = self.again, None
            return frame
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            frame = self.recv_inner(max(deadline - time.monotonic(), 0.0) if timeout is not None else None)
            if self.replay:
                self.replay, self.again = False, frame
            if not self.withhold:
                return frame
            if timeout is not None and time.monotonic() >= deadline:
                raise TimeoutError("withheld")


@pytest.mark.parametrize("meddling", ["replay", "withhold"])
def test_a_stalled_or_refused_chat_link_is_noticed_on_both_sides_and_shown(relay_url, monkeypatch, meddling):
    """Round five: after the relay replayed or withheld one sealed frame the host refused it and
    paired afresh, but the screen was never told: "generating" with no end."""
    from remote_pair import PIECES, REPLY, streamed

    monkeypatch.setattr(chat, "KEEPALIVE_S", 0.2)  # the deadlines are the mechanism's, shortened for the test
    monkeypatch.setattr(chat, "SILENCE_S", 3.0)  # fifteen keepalives: a loaded machine delays one, not fifteen
    head = ScriptedHead()
    host, _, client, _, log = make_pair(relay_url, head)
    ready = threading.Event()
    client.start(lambda e: ready.set() if isinstance(e, RuntimeReady) else None)
    try:
        assert ready.wait(WAIT) and until(lambda: host.link is not None and host._attached)
        meddler = Meddler(host.link.inner)
        head.release(2)
        client.submit([{"role": "user", "content": "tell me"}], Ask(64))
        assert until(lambda: streamed(client) == "".join(PIECES[:2]))
        setattr(meddler, meddling, True)  # the next frame from the screen (its keepalive at the latest)
        assert until(lambda: any("ending this chat client's pairing" in line for line in log)), log
        meddler.withhold = False
        head.release()  # the rest of the reply is made while the screen does not hear the host
        said = [e for e in client.events if isinstance(e, LinkState) and e.state == "reconnecting"]
        assert until(lambda: any(isinstance(e, LinkState) and e.state == "reconnecting" and "nothing from the head"
                                 in e.detail for e in client.events)), said
        assert until(lambda: any(isinstance(e, ReplyFinished) for e in client.events))  # resumed: nothing lost
        assert streamed(client) == REPLY
    finally:
        client.close()
        host.close()
    why = "replayed" if meddling == "replay" else "nothing from the chat client for 3 s"
    assert any(why in line and "ending this chat client's pairing" in line for line in log), log
