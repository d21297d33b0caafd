"""Pilot tests of the TUI against a fake runtime that streams a canned reply from a thread."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from textual.widgets import Static

from sfchat.history import History
from sfchat.params import Ask, GenParams
from sfchat.ui.chat import ReplyMessage, UserMessage
from sfchat.ui.metrics import MetricsPanel
from sfchat.ui.prompt import PromptInput
from sfchat.ui.screens import ConfirmScreen, HistoryScreen

from pilots import (  # noqa: F401  (fixture)
    REPLY, FakeRuntime, chat_app, db, notices, open_history, pilot_test, send, slow_runtime, static_text, stored,
    streaming, wait_for
)


@pilot_test
async def test_reply_streams_and_metrics_fill(db):
    runtime = FakeRuntime()
    ask = Ask(64, GenParams(temperature=0.0))
    async with chat_app(runtime, db, ask, "sfchat test", size=(120, 40)) as (app, pilot):
        await send(pilot, "hello there")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
        await pilot.pause()
        reply = app.query_one(ReplyMessage)
        assert reply.markdown.source == REPLY
        assert reply.status == "complete"
        assert runtime.submitted[0][0] == [{"role": "user", "content": "hello there"}]
        assert runtime.submitted[0][1].max_new_tokens == 64
        panel = app.query_one(MetricsPanel)
        assert panel.display
        speed = " ".join(static_text(app.query_one("#speed")).split())
        fin = runtime.finished  # the panel shows the figures the runtime reports: one tally of the same rounds
        assert f"tok/s mean {fin.tps:.1f}" in speed and f"first token {fin.ttft_s:.2f} s" in speed
        assert "accepted 2.00 of 4" in speed and "prompt 40 (10 cached)" in speed
        timings = " ".join(static_text(app.query_one("#timings")).split())
        assert "RTT p50/p95 82 / 84 ms" in timings and "draft model 5 ms" in timings
        assert "head/tail 3 / 4 ms" in timings
        hist = static_text(app.query_one("#histogram"))
        assert "accepted drafts per round" in hist and "█" in hist
        assert list(app.query_one("#spark-tps").data)
        header = static_text(app.query_one("#header-info"))
        assert "Qwen2.5-7B-Instruct" in header and "K=4" in header and "14/28" in header
        assert "connected" in static_text(app.query_one("#header-link"))
        app.action_copy_reply()
        assert app.clipboard == REPLY
    assert runtime.closed
    history = History(db)
    (chat,) = history.list_chats()
    msgs = history.load_chat(chat.id)
    assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "complete")]
    assert msgs[1].content == REPLY and msgs[1].stats["finish_reason"] == "eos"
    history.close()


@pilot_test
async def test_submit_before_ready_says_still_loading(db):
    async with chat_app(FakeRuntime(ready=False), db, ready=False) as (app, pilot):
        await wait_for(pilot, lambda: app.link_state == "connected")
        await send(pilot, "hi")
        await pilot.pause()
        assert any("Still loading" in str(n.message) for n in app._notifications)
        assert app.query_one(PromptInput).text == "hi"  # kept for when it is ready
        assert not app.query(UserMessage)
        assert app.query_one("#load").display
        assert len(app.query(".load-row")) == 2
        assert "waiting for a tail" not in notices(app)  # the tail came: the notice went


@pilot_test
async def test_escape_cancels_and_marks_partial_reply(db):
    async with chat_app(slow_runtime(), db) as (app, pilot):
        await streaming(pilot, "long one")
        await pilot.pause(0.1)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.session.replying)
        await pilot.pause()
        reply = app.query_one(ReplyMessage)
        assert reply.status == "cancelled"
        assert "[cancelled]" in static_text(reply.query_one(".reply-info"))
        partial = reply.markdown.source
        assert partial.startswith("w0 w1") and len(partial.split()) < 400
    assert stored(db)[1] == ("assistant", partial, "cancelled")


@pilot_test
async def test_chat_survives_restart_and_continues(db):
    first = FakeRuntime(reply="First answer.")
    async with chat_app(first, db) as (app, pilot):
        await send(pilot, "question one")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
        await pilot.press("ctrl+n")
        await send(pilot, "other chat")
        await wait_for(pilot, lambda: not app.session.replying and len(app.session.turns) == 2)

    second = FakeRuntime(reply="Second answer.")
    async with chat_app(second, db) as (app, pilot):
        await open_history(pilot)
        await pilot.press("down", "enter")  # the older chat: the list is newest first
        await wait_for(pilot, lambda: not isinstance(app.screen, HistoryScreen))
        await pilot.pause()
        assert [str(w.render()) for w in app.query(UserMessage)] == ["question one"]
        assert app.query_one(ReplyMessage).markdown.source == "First answer."
        assert second.new_chats == 1
        await send(pilot, "follow up")
        await wait_for(pilot, lambda: len(app.session.turns) == 4 and not app.session.replying)
        assert second.submitted[0][0] == [
            {"role": "user", "content": "question one"},
            {"role": "assistant", "content": "First answer."},
            {"role": "user", "content": "follow up"},
        ]
        # Up recalls prompts, this session's and the stored ones.
        await pilot.press("up")
        assert app.query_one(PromptInput).text == "follow up"
        await pilot.press("up")
        assert app.query_one(PromptInput).text == "other chat"
        await pilot.press("down", "down")
        assert app.query_one(PromptInput).text == ""


@pilot_test
async def test_crashed_stream_is_shown_interrupted(db):
    history = History(db)
    chat = history.new_chat("crashed chat", "m")
    history.add_message(chat, "user", "tell me")
    history.add_message(chat, "assistant", "half a rep", status="streaming")
    history.close()
    async with chat_app(FakeRuntime(), db) as (app, pilot):
        await open_history(pilot)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query(ReplyMessage))
        reply = app.query_one(ReplyMessage)
        assert reply.status == "interrupted"
        assert "[interrupted]" in static_text(reply.query_one(".reply-info"))
        assert reply.markdown.source == "half a rep"


@pilot_test
async def test_history_screen_deletes_a_chat_but_not_the_open_one(db):
    history = History(db)
    for title in ("old", "new"):
        history.add_message(history.new_chat(title), "user", title)
    history.close()
    async with chat_app(FakeRuntime(), db) as (app, pilot):
        await open_history(pilot)
        await pilot.press("enter")  # open "new"
        await wait_for(pilot, lambda: app.session.title == "new")
        await open_history(pilot)
        await pilot.press("delete")  # the open chat: refused
        assert [c.title for c in app.history.list_chats()] == ["new", "old"]
        await pilot.press("down", "delete")  # asked first: "n" keeps it
        await pilot.pause(0.1)
        assert [c.title for c in app.history.list_chats()] == ["new", "old"]
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "Delete the chat “old” (1 message)?" in static_text(app.screen.query_one(Static))
        await pilot.press("n")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        assert [c.title for c in app.history.list_chats()] == ["new", "old"]
        await pilot.press("delete")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        assert [c.title for c in app.history.list_chats()] == ["new"]
        await pilot.press("escape")
        assert not isinstance(app.screen, HistoryScreen)


@pilot_test
async def test_runtime_failure_is_a_notice_not_a_traceback(db):
    async with chat_app(FakeRuntime(fail_with="the tail went away"), db) as (app, pilot):
        await send(pilot, "hi")
        await wait_for(pilot, lambda: "the tail went away" in notices(app))
        assert not app.query(ReplyMessage) and not app.session.replying
        assert app.is_running


@pilot_test
async def test_context_exhaustion_is_said_in_the_chat(db):
    async with chat_app(FakeRuntime(reply="Out of room", finish_reason="context"), db) as (app, pilot):
        await send(pilot, "hi")
        await wait_for(pilot, lambda: "filled the context window (4096 tokens)" in notices(app))
        assert "oldest turns" in notices(app)  # the next message goes on: nothing says to start afresh
        reply = app.query_one(ReplyMessage)
        info = " ".join(static_text(reply.query_one(".reply-info")).split())
        assert reply.status == "complete" and "context window full" in info


@pilot_test
async def test_narrow_terminal_hides_panel_and_still_chats(db):
    async with chat_app(FakeRuntime(reply="Short."), db, size=(80, 24)) as (app, pilot):
        panel = app.query_one(MetricsPanel)
        prompt = app.query_one(PromptInput)
        assert not panel.display and prompt.region.height >= 3
        assert prompt.region.bottom <= 23  # above the footer
        await send(pilot, "hi")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
        await pilot.pause()
        assert app.query_one(ReplyMessage).markdown.source == "Short."
        assert "tok/s" in static_text(app.query_one("#status"))
        await pilot.press("f3")
        await pilot.pause()
        assert panel.display


@pilot_test
async def test_newline_keys_and_command_palette_commands(db):
    async with chat_app(FakeRuntime(), db) as (app, pilot):
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert app.query_one(PromptInput).text == "a\nb\nc"
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"New chat", "History", "Metrics panel", "Copy reply", "Quit"} <= titles


def test_ui_import_is_torch_free():
    code = ("import sys, sfchat.ui, sfchat.history; "
            "bad = [m for m in sys.modules if m == 'torch' or m.split('.')[:2] in (['sfchat', 'model'], ['sfchat', 'engine'], ['sfchat', 'node'])]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
