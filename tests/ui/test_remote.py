"""The chat screen driving a head elsewhere (``sfchat --remote`` / ``--offer-chat``), end to end
through a real relay on loopback: pairing by the chat code (a wrong one asked again), streaming with
the head's figures in the panel, cancel, the tail's code asked for on the screen, and a reconnect
of either side mid-reply that loses and repeats nothing. The head's runtime is scripted: each
round waits for the test to release it, so "mid-reply" and "while the link is down" are states the
test reaches, never moments it times."""

from __future__ import annotations

import threading

import pytest
from relay_process import TOKEN

from sfchat.events import (
    LinkState, ReplyFinished, ReplyStarted, RoundStats, RuntimeFailed, RuntimeReady, TokensCommitted,
)
from sfchat.history import History
from sfchat.link.relay import RelayLink
from sfchat.params import Ask, GenParams
from sfchat.protocol import chat
from sfchat.remote.host import ChatHost, fold
from sfchat.ui.chat import ReplyMessage
from sfchat.ui.screens import CodeScreen

from pilots import READY, chat_app, notices, pilot_test, send, stored, wait_for
from remote_pair import CODE, PIECES, REPLY, SESSION, WAIT, RecordingRemote, ScriptedHead, make_pair, streamed, until


def shown_reply(app) -> str:
    replies = list(app.query(ReplyMessage))
    return replies[-1].markdown.source if replies else ""


async def type_code(pilot, code: str) -> None:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, CodeScreen), WAIT)
    for key in code:
        await pilot.press(key)
    await pilot.press("enter")


@pilot_test
async def test_a_wrong_chat_code_is_asked_again_then_the_reply_streams_with_the_heads_figures(relay_url, tmp_path):
    head = ScriptedHead()
    host, _, client, _, log = make_pair(relay_url, head, client_code="4-wrong-code")
    db = tmp_path / "home.sqlite3"
    ask = Ask(64, GenParams(temperature=0.0))
    async with chat_app(client, db, ask, size=(120, 40), ready=False) as (app, pilot):
        await wait_for(pilot, lambda: isinstance(app.screen, CodeScreen), WAIT)
        assert "wrong chat code" in app.screen.reason
        await type_code(pilot, "4-still-wrong")
        await wait_for(pilot, lambda: isinstance(app.screen, CodeScreen) and "wrong" in app.screen.reason, WAIT)
        await type_code(pilot, CODE)
        await wait_for(pilot, lambda: app.ready is not None, WAIT)
        assert app.ready.model == READY.model and not isinstance(app.screen, CodeScreen)
        head.release()
        await send(pilot, "explain speculative decoding")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns, WAIT)
        await pilot.pause()
        assert shown_reply(app) == REPLY
        figures = app.meter.figures()
        assert figures.rtt_p50_ms == pytest.approx(80.0) and figures.draft_ms == pytest.approx(5.0)
        assert figures.tokens == len(PIECES)
    host.close()
    assert head.submitted[0][0] == [{"role": "user", "content": "explain speculative decoding"}]
    assert head.submitted[0][1].max_new_tokens == 64
    history = History(db)  # the history is the client's
    (stored,) = history.list_chats()
    assert [m.content for m in history.load_chat(stored.id)] == ["explain speculative decoding", REPLY]
    history.close()
    assert sum("a pairing attempt failed" in line for line in log) == 2, log


@pilot_test
async def test_turns_the_head_left_out_of_the_context_are_said_on_the_remote_screen(relay_url, tmp_path):
    head = ScriptedHead(dropped_turns=3)
    host, _, client, _, _ = make_pair(relay_url, head)
    async with chat_app(client, tmp_path / "home.sqlite3", Ask(64), size=(120, 40), wait=WAIT) as (app, pilot):
        head.release()
        await send(pilot, "go on")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns, WAIT)
        await pilot.pause()
        shown = notices(app)
    host.close()
    assert "context window (4096 tokens): its oldest 3 turns are left out" in shown


@pytest.mark.parametrize("side", ["client", "host"])
@pilot_test
async def test_a_reconnect_of_either_side_mid_reply_loses_and_repeats_nothing(relay_url, tmp_path, side):
    head = ScriptedHead()
    host, host_dial, client, client_dial, _ = make_pair(relay_url, head)
    async with chat_app(client, tmp_path / "home.sqlite3", Ask(64), size=(120, 40), wait=WAIT) as (app, pilot):
        head.release(4)
        await send(pilot, "tell me")
        await wait_for(pilot, lambda: streamed(client) == "".join(PIECES[:4]), WAIT)
        host_dial.open.clear()
        client_dial.open.clear()
        if side == "client":
            client._link.close()  # the laptop's connection drops
        else:
            host.link.inner.close()  # the notebook's connection drops
        # the other side notices, and the rest of the reply is made while the link is down
        await wait_for(pilot, lambda: host.updates._link is None, WAIT)
        head.release()
        await wait_for(pilot, head.finished.is_set, WAIT)
        assert streamed(client) == "".join(PIECES[:4])
        await wait_for(pilot, lambda: any(isinstance(e, LinkState) and e.state == "reconnecting"
                                          for e in client.events), WAIT)
        (host_dial if side == "host" else client_dial).open.set()
        client_dial.open.set()  # the client dials again too when the host left
        await wait_for(pilot, lambda: not app.session.replying, WAIT)
        await pilot.pause()
        assert shown_reply(app) == REPLY
        assert streamed(client) == REPLY  # every round once, in order
        finished = [e for e in client.events if isinstance(e, ReplyFinished)]
        assert len(finished) == 1 and finished[0].text == REPLY and len(finished[0].token_ids) == len(PIECES)
        assert app.link_state == "connected"
        head.release()
        await send(pilot, "and again")  # the link after the reconnect carries the next reply too
        await wait_for(pilot, lambda: len([e for e in client.events if isinstance(e, ReplyFinished)]) == 2, WAIT)
    host.close()
    assert len(head.submitted) == 2  # the first request reached the head once, not again after the reconnect


@pilot_test
async def test_escape_cancels_the_remote_reply_and_keeps_its_prefix(relay_url, tmp_path):
    head = ScriptedHead()
    host, _, client, _, _ = make_pair(relay_url, head)
    db = tmp_path / "home.sqlite3"
    async with chat_app(client, db, Ask(64), size=(120, 40), wait=WAIT) as (app, pilot):
        head.release(3)
        await send(pilot, "go on")
        await wait_for(pilot, lambda: streamed(client) == "".join(PIECES[:3]), WAIT)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.session.replying, WAIT)
        await pilot.pause()
        partial = shown_reply(app)
    host.close()
    assert head.cancels == 1 and partial == "".join(PIECES[:3])
    assert stored(db)[1] == ("assistant", partial, "cancelled")


@pilot_test
async def test_the_tails_pairing_code_is_asked_on_the_home_screen_and_reaches_the_head(relay_url, tmp_path):
    head = ScriptedHead(ask_code=True)
    host, _, client, _, _ = make_pair(relay_url, head)
    async with chat_app(client, tmp_path / "home.sqlite3", size=(120, 40), ready=False) as (app, pilot):
        await wait_for(pilot, lambda: isinstance(app.screen, CodeScreen), WAIT)
        assert "did not accept it" in app.screen.reason
        await type_code(pilot, "9-new-tail-code")
        await wait_for(pilot, lambda: app.ready is not None, WAIT)
    host.close()
    assert head.codes == ["9-new-tail-code"]


@pilot_test
async def test_a_second_client_starts_afresh_and_the_first_ones_reply_is_not_sent_to_it(relay_url, tmp_path):
    head = ScriptedHead()
    host, _, first, _, _ = make_pair(relay_url, head)
    ready = threading.Event()
    first.start(lambda e: ready.set() if isinstance(e, RuntimeReady) else None)
    assert ready.wait(WAIT)
    head.release(2)
    first.submit([{"role": "user", "content": "first"}], Ask())
    assert until(lambda: len(streamed(first)) > 0)  # the first reply is under way
    first.close()  # and its screen goes away mid-reply
    assert first.join(WAIT)
    second = RecordingRemote(lambda: RelayLink(relay_url, TOKEN, SESSION, "head"), CODE, SESSION)
    async with chat_app(second, tmp_path / "other.sqlite3", size=(120, 40), wait=WAIT) as (app, pilot):
        await wait_for(pilot, head.finished.is_set, WAIT)  # the first reply was cancelled for the newcomer
        assert head.cancels == 1
        head.release()
        await send(pilot, "second")
        await wait_for(pilot, lambda: not app.session.replying, WAIT)
        await pilot.pause()
        assert shown_reply(app) == REPLY
    host.close()
    assert streamed(second) == REPLY  # nothing of the first client's reply


class Wire:
    """A link that keeps what the host sends."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, frame: bytes) -> None:
        self.sent.append(chat.decode(frame))


def test_a_client_cannot_queue_replies_without_bound_and_unseen_rounds_fold():
    head = ScriptedHead()
    host = ChatHost(head, dial=lambda: None, log=lambda line: None)
    head.listener = host._on_event
    wire = Wire()
    host._take(chat.Attach("ab" * 16, "", 0), wire)
    for n in range(1, 11):  # a client asking for ten replies at once
        host._take(chat.Submit(n, n, (("user", "hi"),), Ask()), wire)
    assert len(head.submitted) == 2
    refused = [u for u in host.updates._items if isinstance(u.event, RuntimeFailed)]
    assert len(refused) == 8
    # the scripted replies start on threads of their own: wait for both starts, so that none lands
    # between the rounds below (a start is not a round, and would split them)
    assert until(lambda: sum(isinstance(u.event, ReplyStarted) for u in list(host.updates._items)) == 2)
    host.updates.detach()  # nobody attached: what comes now is seen by no one yet
    before = len(host.updates)
    for i in range(100):
        host._on_event(TokensCommitted("x", (i,), RoundStats(0, 1, 1.0, 1.0, 1.0, 80.0, 90.0), 0.1))
    host._on_event(LinkState("reconnecting", "a"))
    host._on_event(LinkState("connected", "b"))
    kept = host.updates.rewrite_unsent(fold)
    rounds = [u for u in host.updates._items if isinstance(u.event, TokensCommitted)]
    assert len(rounds) == 1 and rounds[0].event.text == "x" * 100 and rounds[0].event.stats.committed == 100
    assert [u.event.state for u in host.updates._items if isinstance(u.event, LinkState)] == ["connected"]
    assert kept == before + 2
    seqs = [u.seq for u in host.updates._items]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # still numbered one after another
    host.updates.close()
