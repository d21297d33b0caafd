"""Pilot tests of the TUI against a fake runtime that streams a canned reply from a thread."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from textual.widgets import Static

from sfchat.events import (
    LinkState, LoadProgress, ReplyFinished, ReplyStarted, RoundStats, RuntimeFailed,
    RuntimeReady, TokensCommitted,
)
from sfchat.tally import Tally
from sfchat.history import History
from sfchat.params import Ask, GenParams
from sfchat.ui import SfchatApp
from sfchat.ui.chat import Notice, ReplyMessage, UserMessage
from sfchat.ui.metrics import MetricsPanel
from sfchat.ui.prompt import PromptInput
from sfchat.ui.screens import ConfirmScreen, HistoryScreen

K = 4
REPLY = ("Speculative decoding lets a **small draft model** propose tokens that the big "
         "model checks in one pass, so the network round trip is paid once per round.")
READY = RuntimeReady(model="Qwen/Qwen2.5-7B-Instruct", draft="Qwen/Qwen2.5-0.5B-Instruct",
                     split=14, n_layers=28, dtype="bf16", k=K, device="cpu", mode="relay",
                     max_context=4096)


class FakeRuntime:
    """Streams REPLY word by word from its own thread, like the real runtime; honours cancel."""

    def __init__(self, reply: str = REPLY, round_s: float = 0.002, ready: bool = True,
                 fail_with: str | None = None, finish_reason: str = "eos") -> None:
        self.reply, self.round_s, self.ready, self.fail_with = reply, round_s, ready, fail_with
        self.finish_reason = finish_reason
        self.submitted: list[tuple[list[dict], dict]] = []
        self.new_chats = 0
        self.closed = False
        self._cancel = threading.Event()
        self._listener = None

    def start(self, listener) -> None:
        self._listener = listener
        threading.Thread(target=self._load, daemon=True).start()

    def _load(self) -> None:
        emit = self._listener
        emit(LinkState("waiting", "waiting for a tail: run sfchat --tail"))
        for node in ("head", "tail"):
            for done in range(0, 5):
                emit(LoadProgress(node, "load", done, 4, f"layer {done}"))
        emit(LinkState("connected", "rtt 80 ms"))
        if self.ready:
            emit(READY)

    def submit(self, messages, params) -> None:
        self.submitted.append((messages, params))
        self._cancel.clear()
        threading.Thread(target=self._generate, daemon=True).start()

    def _generate(self) -> None:
        emit = self._listener
        if self.fail_with:
            emit(RuntimeFailed(self.fail_with))
            return
        emit(ReplyStarted(prompt_tokens=40, reused_tokens=10, prefill_tokens=30))
        words = self.reply.split(" ")
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        text, hist, rounds, start = "", [0] * (K + 1), 0, time.monotonic()
        tally = Tally(K)
        reason = self.finish_reason
        i = 0
        while i < len(pieces):
            if self._cancel.is_set():
                reason = "cancelled"
                break
            accepted = rounds % (K + 1)
            chunk = "".join(pieces[i:i + accepted + 1])
            i += accepted + 1
            text += chunk
            hist[accepted] += 1
            rounds += 1
            stats = RoundStats(accepted=accepted, committed=accepted + 1, draft_ms=5.0,
                               head_ms=3.0, tail_ms=4.0, rtt_ms=80.0 + accepted, round_ms=100.0)
            elapsed = time.monotonic() - start
            emit(TokensCommitted(chunk, tuple(range(accepted + 1)), stats, elapsed))
            tally.add(stats, elapsed)
            time.sleep(self.round_s)
        n = len(text.split(" "))
        # as a real head does: the reply's figures are the tally of its rounds
        self.finished = ReplyFinished(reason, text, tuple(range(n)), 40, **tally.figures())
        emit(self.finished)

    def cancel(self) -> None:
        self._cancel.set()

    def new_chat(self) -> None:
        self.new_chats += 1

    def close(self) -> None:
        self.closed = True


def pilot_test(fn):
    """Run an async test body on a fresh event loop (no async pytest plugin needed)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))

    return run


async def wait_for(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


async def open_history(pilot) -> None:
    """F2, then wait until the history screen is up."""
    await pilot.press("f2")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, HistoryScreen))


def static_text(widget) -> str:
    """What the widget shows on screen, as plain text lines."""
    from textual.geometry import Region

    lines = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return "\n".join(line.text.rstrip() for line in lines)


def notices(app) -> str:
    return "\n".join(str(n.render()) for n in app.query(Notice))


async def send(pilot, text: str) -> None:
    for ch in text:
        await pilot.press("space" if ch == " " else ch)
    await pilot.press("enter")


@pytest.fixture
def db(tmp_path):
    return tmp_path / "history.sqlite3"


@pilot_test
async def test_reply_streams_and_metrics_fill(db):
    runtime = FakeRuntime()
    app = SfchatApp(runtime, db, Ask(64, GenParams(temperature=0.0)), "sfchat test")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
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
    app = SfchatApp(FakeRuntime(ready=False), db)
    async with app.run_test(size=(100, 30)) as pilot:
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
    runtime = FakeRuntime(reply=" ".join(f"w{i}" for i in range(400)), round_s=0.02)
    app = SfchatApp(runtime, db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
        await send(pilot, "long one")
        await wait_for(pilot, lambda: app.state == "streaming")
        await pilot.pause(0.1)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.session.replying)
        await pilot.pause()
        reply = app.query_one(ReplyMessage)
        assert reply.status == "cancelled"
        assert "[cancelled]" in static_text(reply.query_one(".reply-info"))
        partial = reply.markdown.source
        assert partial.startswith("w0 w1") and len(partial.split()) < 400
    history = History(db)
    stored = history.load_chat(history.list_chats()[0].id)[1]
    assert (stored.status, stored.content) == ("cancelled", partial)
    history.close()


@pilot_test
async def test_chat_survives_restart_and_continues(db):
    first = FakeRuntime(reply="First answer.")
    app = SfchatApp(first, db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
        await send(pilot, "question one")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
        await pilot.press("ctrl+n")
        await send(pilot, "other chat")
        await wait_for(pilot, lambda: not app.session.replying and len(app.session.turns) == 2)

    second = FakeRuntime(reply="Second answer.")
    app = SfchatApp(second, db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
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
    app = SfchatApp(FakeRuntime(), db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
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
    app = SfchatApp(FakeRuntime(), db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
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
    app = SfchatApp(FakeRuntime(fail_with="the tail went away"), db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
        await send(pilot, "hi")
        await wait_for(pilot, lambda: "the tail went away" in notices(app))
        assert not app.query(ReplyMessage) and not app.session.replying
        assert app.is_running


@pilot_test
async def test_context_exhaustion_is_said_in_the_chat(db):
    app = SfchatApp(FakeRuntime(reply="Out of room", finish_reason="context"), db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
        await send(pilot, "hi")
        await wait_for(pilot, lambda: "filled the context window (4096 tokens)" in notices(app))
        assert "oldest turns" in notices(app)  # the next message goes on: nothing says to start afresh
        reply = app.query_one(ReplyMessage)
        info = " ".join(static_text(reply.query_one(".reply-info")).split())
        assert reply.status == "complete" and "context window full" in info


@pilot_test
async def test_narrow_terminal_hides_panel_and_still_chats(db):
    app = SfchatApp(FakeRuntime(reply="Short."), db)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
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
    app = SfchatApp(FakeRuntime(), db)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.ready is not None)
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert app.query_one(PromptInput).text == "a\nb\nc"
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"New chat", "History", "Metrics panel", "Copy reply", "Quit"} <= titles


def test_ui_import_is_torch_free():
    code = ("import sys, sfchat.ui, sfchat.history; "
            "bad = [m for m in sys.modules if m == 'torch' or m.split('.')[:2] in (['sfchat', 'model'], ['sfchat', 'engine'], ['sfchat', 'node'])]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
