"""Pilot tests of the chat's flow around a reply: Enter while a reply is written queues the message,
the pairing code is asked for (again after a wrong one), and a locked history file is an error
notice rather than a crash."""

from __future__ import annotations

import sqlite3
import threading

from textual.widgets import Input

import sfchat.history
from sfchat.events import CodeWanted, LinkState, ReplyStarted, RoundStats, RuntimeFailed, TokensCommitted
from sfchat.ui.chat import ReplyMessage, UserMessage
from sfchat.ui.prompt import PromptInput

from pilots import READY, FakeRuntime, chat_app, db, notices, pilot_test, send, streaming, wait_for  # noqa: F401

LONG = " ".join(f"w{i}" for i in range(4000))  # streams for longer than any test waits
GOOD_CODE = "7-crossover-clockwork"
HOSTILE_REASON = "wrong pairing code [bold]x[/bold]\x1b[2J: the tail refused it"


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


@pilot_test
async def test_enter_while_a_reply_is_written_queues_the_message_and_sends_it_after(db):
    runtime = FakeRuntime(reply=LONG, round_s=0.05)
    async with chat_app(runtime, db) as (app, pilot):
        await streaming(pilot, "first")
        app.query_one(PromptInput).load_text("next one")  # typed while the reply streams
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert app.query_one(PromptInput).text == ""  # taken, not left there silently
        assert "Queued, sent when this reply ends" in notices(app) and "next one" in notices(app)
        assert len(runtime.submitted) == 1
        await pilot.press("escape")  # the reply ends early: the queued message goes at once
        await wait_for(pilot, lambda: len(runtime.submitted) == 2)
        assert runtime.submitted[1][0][-1] == {"role": "user", "content": "next one"}
        assert runtime.submitted[1][0][1]["role"] == "assistant"  # after the cancelled reply's text
        await wait_for(pilot, lambda: app.state == "streaming")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.session.replying)
        await pilot.pause()
        assert [str(w.render()) for w in app.query(UserMessage)] == ["first", "next one"]
        assert "Queued" not in notices(app)
        assert [r.status for r in app.query(ReplyMessage)] == ["cancelled", "cancelled"]


class FailingRuntime(FakeRuntime):
    """A reply that streams one round, then fails once ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = threading.Event()

    def _generate(self) -> None:
        self._listener(ReplyStarted(prompt_tokens=4, reused_tokens=0, prefill_tokens=4))
        self._listener(TokensCommitted("Hel", (1,), RoundStats(0, 1, 1.0, 1.0, 1.0, 80.0, 90.0), 0.1))
        self.fail.wait(10)
        self._listener(RuntimeFailed("the tail went away"))


@pilot_test
async def test_a_queued_message_goes_back_to_the_editor_when_the_reply_fails(db):
    runtime = FailingRuntime()
    async with chat_app(runtime, db) as (app, pilot):
        await streaming(pilot, "first")
        app.query_one(PromptInput).load_text("second")
        await pilot.press("enter")
        await wait_for(pilot, lambda: "Queued" in notices(app))
        runtime.fail.set()
        await wait_for(pilot, lambda: "the tail went away" in notices(app))
        await pilot.pause()
        assert app.query_one(PromptInput).text == "second" and len(runtime.submitted) == 1
        assert "Queued" not in notices(app)


class PairingRuntime(FakeRuntime):
    """Wants the pairing code until it is given ``GOOD_CODE``, then loads."""

    def __init__(self) -> None:
        super().__init__()
        self.codes: list[str] = []
        self._code_given = threading.Event()

    def set_code(self, code: str) -> None:
        self.codes.append(code)
        self._code_given.set()

    def _load(self) -> None:
        emit = self._listener
        emit(LinkState("waiting", "waiting for a tail on session 'x'"))
        reason = "the tail printed a pairing code: type it here"
        while True:
            emit(CodeWanted(reason))
            self._code_given.wait(10)
            self._code_given.clear()
            if self.codes and self.codes[-1] == GOOD_CODE:
                break
            reason = HOSTILE_REASON
        emit(LinkState("connected", "ws://relay"))
        emit(READY)


@pilot_test
async def test_a_wrong_pairing_code_is_asked_for_again_masked_and_then_the_chat_goes_on(db):
    runtime = PairingRuntime()
    async with chat_app(runtime, db, size=(80, 24), ready=False) as (app, pilot):
        await wait_for(pilot, lambda: bool(app.screen.query(Input)) and app.screen.query_one(Input).has_focus)
        field = app.screen.query_one(Input)
        assert field.password
        assert "the tail printed a pairing code" in screen_text(app)
        for ch in "1-wrong-guess":
            await pilot.press(ch)
        await pilot.pause(0.1)
        assert "1-wrong-guess" not in screen_text(app)  # masked
        await pilot.press("enter")
        await wait_for(pilot, lambda: "refused" in screen_text(app))
        shown = screen_text(app)
        assert "wrong pairing code [bold]x[/bold]: the tail refused it" in shown  # literally, no escapes
        field = app.screen.query_one(Input)
        assert field.value == "" and field.password
        await pilot.press("enter")  # an empty field is not a code
        await pilot.pause(0.1)
        assert runtime.codes == ["1-wrong-guess"]
        for ch in GOOD_CODE:
            await pilot.press(ch)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.ready is not None)
        assert runtime.codes == ["1-wrong-guess", GOOD_CODE]
        assert not app.screen.query(Input) and not app.failed
        await send(pilot, "hello")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
        assert app.query_one(ReplyMessage).status == "complete"


@pilot_test
async def test_a_locked_history_is_an_error_notice_that_keeps_the_prompt(db, monkeypatch):
    monkeypatch.setattr(sfchat.history, "LOCK_TIMEOUT_S", 0.3, raising=False)
    runtime = FakeRuntime(reply="Fine.")
    async with chat_app(runtime, db) as (app, pilot):
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")  # another program holds the write lock
        await send(pilot, "hello")
        await wait_for(pilot, lambda: "locked" in notices(app))
        shown = notices(app)
        assert str(db) in shown and "--history" in shown, shown
        assert app.query_one(PromptInput).text == "hello" and not runtime.submitted
        assert app.is_running and not app.query(UserMessage)
        other.execute("ROLLBACK")
        other.close()
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
        assert [m.content for m in app.history.load_chat(app.session.chat_id)] == ["hello", "Fine."]
        assert [str(w.render()) for w in app.query(UserMessage)] == ["hello"]
