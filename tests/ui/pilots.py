"""What the UI tests share: a fake runtime that streams a canned reply from a thread, the chat app
under Textual's Pilot once its runtime is ready, the helpers that drive it and read what it shows
and what its history keeps, and a mixin that records what a runtime reports."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import pytest

from sfchat.events import (
    LinkState, LoadProgress, ReplyFinished, ReplyStarted, RoundStats, RuntimeFailed,
    RuntimeReady, TokensCommitted,
)
from sfchat.history import History
from sfchat.params import Ask
from sfchat.tally import Tally
from sfchat.ui import SfchatApp
from sfchat.ui.chat import Notice, UserMessage
from sfchat.ui.prompt import PromptInput
from sfchat.ui.screens import HistoryScreen, SystemScreen


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
        self.submitted: list[tuple[list[dict], Ask]] = []
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


@contextlib.asynccontextmanager
async def chat_app(runtime, db, *args, size=(100, 30), ready: bool = True, wait: float = 30.0, **kwargs):
    """``SfchatApp(runtime, db, *args, **kwargs)`` under Pilot in a terminal of ``size``: yields
    (app, pilot), once the runtime has reported ready (within ``wait`` seconds) unless ``ready`` is
    False."""
    app = SfchatApp(runtime, db, *args, **kwargs)
    async with app.run_test(size=size) as pilot:
        if ready:
            await wait_for(pilot, lambda: app.ready is not None, wait)
        yield app, pilot


def slow_runtime(words: int = 400) -> FakeRuntime:
    """A reply of ``words`` words at 20 ms a round: long enough to act on while it streams."""
    return FakeRuntime(reply=" ".join(f"w{i}" for i in range(words)), round_s=0.02)


async def streaming(pilot, text: str, wait: float = 30.0) -> None:
    """Send ``text``, then wait until its reply streams."""
    await send(pilot, text)
    await wait_for(pilot, lambda: pilot.app.state == "streaming", wait)


def stored(db) -> list[tuple[str, str, str]]:
    """(role, content, status) of each message of the history's one chat."""
    history = History(db)
    try:
        (chat,) = history.list_chats()
        return [(m.role, m.content, m.status) for m in history.load_chat(chat.id)]
    finally:
        history.close()


class Recording:
    """Mixed in before a runtime (``class R(Recording, Runtime)``): keeps every event it reports in
    ``events``, in order."""

    def start(self, listener) -> None:
        self.events = []

        def record(event):
            self.events.append(event)
            listener(event)

        super().start(record)


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


def shown(app) -> list[tuple[str, str]]:
    """The turns on screen, in order."""
    out = []
    for w in app.query("UserMessage, ReplyMessage"):
        out.append(("user", str(w.render())) if isinstance(w, UserMessage) else ("assistant", w.markdown.source))
    return out


async def replied(pilot, app, turns: int) -> None:
    await wait_for(pilot, lambda: not app.session.replying and len(app.session.turns) == turns)
    await pilot.pause()


def warned(app, text: str) -> bool:
    return any(text in str(n.message) for n in app._notifications)


async def retype(pilot, app, text: str) -> None:
    """Empty the editor with Backspace and type ``text``."""
    for _ in app.query_one(PromptInput).text:
        await pilot.press("backspace")
    await send(pilot, text)


async def set_system(pilot, text: str) -> None:
    """F5, empty the editor, type ``text``, Enter."""
    app = pilot.app
    await pilot.press("f5")
    await wait_for(pilot, lambda: isinstance(app.screen, SystemScreen))
    editor = app.screen.query_one("#system-input")
    for _ in editor.text:
        await pilot.press("backspace")
    for ch in text:
        await pilot.press("space" if ch == " " else ch)
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, SystemScreen))


def screen_lines(app) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]
