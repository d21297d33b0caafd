"""Pilot tests of what the chat screen shows: network text as plain text (never markup, never
escape codes), the "waiting for a tail" notice gone once the tail is there, no stale figures
after a new chat, every metrics row reachable at 80x24, and loading labels."""

from __future__ import annotations

import threading

from textual.content import Content

from sfchat.events import LinkState, ReplyStarted, RoundStats, RuntimeFailed, TokensCommitted
from sfchat.history import History
from sfchat.plaintext import plain
from sfchat.ui.chat import ReplyMessage

from pilots import (  # noqa: F401  (fixtures)
    READY, FakeRuntime, chat_app, db, notices, open_history, pilot_test, screen_lines, send, slow_runtime,
    static_text, streaming, wait_for
)

HOSTILE_CLOSE = "[/]"
HOSTILE_TOAST = "[bold red]FAKE[/]"
HOSTILE_ERROR = "tail: \x1b[2J\x1b[H\x1b]0;owned\x07re-enter your secret:\x1b[31m [bold]now[/bold]\r\n"


class HostileRuntime(FakeRuntime):
    """A reply during which the relay sends markup as close reasons and an ERROR with escapes."""

    def _generate(self) -> None:
        emit = self._listener
        emit(ReplyStarted(prompt_tokens=4, reused_tokens=0, prefill_tokens=4))
        stats = RoundStats(1, 2, 1.0, 1.0, 1.0, 1.0, 4.0)
        emit(TokensCommitted("Hello", (1, 2), stats, 0.1))
        emit(LinkState("reconnecting", HOSTILE_CLOSE))
        emit(LinkState("stalled", HOSTILE_TOAST))
        emit(RuntimeFailed(HOSTILE_ERROR))


def toast_texts(app) -> list[tuple[str, list]]:
    """What each notification's toast shows (rendered as Textual's Toast does), and its styles."""
    shown = []
    for n in app._notifications:
        content = Content.from_markup(n.message) if n.markup else Content(n.message)
        shown.append((content.plain, [span.style for span in content.spans]))
    return shown


def test_plain_strips_escapes_and_controls_and_keeps_text():
    assert plain(HOSTILE_ERROR) == "tail: re-enter your secret: [bold]now[/bold]  "
    assert plain("\x9b2J\x1bPqdata\x1b\\ok\x00\x7f") == "ok"
    assert plain("naïve — 3 < 4 [x]") == "naïve — 3 < 4 [x]"
    assert len(plain("a" * 10_000)) <= 2001


@pilot_test
async def test_markup_from_the_network_is_shown_literally_and_kills_nothing(db):
    async with chat_app(HostileRuntime(), db, size=(120, 40)) as (app, pilot):
        await send(pilot, "hi")
        await wait_for(pilot, lambda: not app.session.replying)
        await pilot.pause(0.3)
        assert app.is_running
        toasts = toast_texts(app)
        texts = [text for text, _ in toasts]
        assert any(HOSTILE_CLOSE in t for t in texts), texts
        fake = [styles for t, styles in toasts if HOSTILE_TOAST in t]
        assert fake and fake[0] == [], toasts  # the brackets are on screen and styled nothing
        error = [t for t in texts if "re-enter your secret" in t]
        assert error and all("\x1b" not in t and "\x07" not in t for t in texts)
        assert "[bold]now[/bold]" in error[0]
        assert "\x1b" not in notices(app) and "re-enter your secret" in notices(app)
        assert app.query_one(ReplyMessage).status == "interrupted"
    history = History(db)
    chat = history.list_chats()[0]
    assert [m.status for m in history.load_chat(chat.id)] == ["complete", "interrupted"]
    history.close()


class SlowTailRuntime(FakeRuntime):
    """Waits for a tail until ``tail_arrives`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.tail_arrives = threading.Event()

    def _load(self) -> None:
        emit = self._listener
        emit(LinkState("waiting", "waiting for a tail on session 'x': run sfchat --tail"))
        self.tail_arrives.wait(10)
        emit(LinkState("connected", "ws://relay"))
        emit(READY)


@pilot_test
async def test_the_waiting_notice_goes_when_the_tail_comes(db):
    runtime = SlowTailRuntime()
    async with chat_app(runtime, db, ready=False) as (app, pilot):
        await wait_for(pilot, lambda: "waiting for a tail" in notices(app))
        runtime.tail_arrives.set()
        await wait_for(pilot, lambda: app.ready is not None)
        await pilot.pause()
        assert "waiting for a tail" not in notices(app)


@pilot_test
async def test_a_new_chat_shows_no_figures_of_the_last_reply(db):
    runtime = FakeRuntime()
    async with chat_app(runtime, db, size=(120, 40)) as (app, pilot):
        await send(pilot, "hello there")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
        await pilot.pause()
        assert f"{runtime.finished.tps:.1f}" in static_text(app.query_one("#speed"))
        assert "tok/round" in static_text(app.query_one("#status"))
        await pilot.press("ctrl+n")
        await pilot.pause()
        speed = " ".join(static_text(app.query_one("#speed")).split())
        assert "tok/s mean –" in speed and "first token –" in speed and "prompt" not in speed
        assert "█" not in static_text(app.query_one("#histogram"))
        assert static_text(app.query_one("#status")).strip() == "ready"


@pilot_test
async def test_at_80x24_the_footer_status_and_every_panel_row_fit(db):
    async with chat_app(slow_runtime(300), db, size=(80, 24)) as (app, pilot):
        await streaming(pilot, "hello there")
        await pilot.pause(0.2)
        footer = screen_lines(app)[-1]
        assert "esc Cancel" in footer and "^q Quit" in footer and "^p" in footer, footer
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.session.replying)
        await pilot.press("f3")
        await pilot.pause(0.2)
        status = static_text(app.query_one("#status")).strip()
        assert "…" not in status and status.startswith("ready  ") and "tok" in status, status
        assert status.split(" · ")[-1][-1].isalpha(), status  # the last figure is whole
        panel = app.query_one("#metrics")
        for row in ("#speed", "#timings", "#setup"):  # in view without scrolling
            widget = app.query_one(row)
            assert panel.region.contains_region(widget.region), (row, panel.region, widget.region)
        shown = "\n".join(screen_lines(app))
        for label in ("tok/s now", "RTT p50/p95", "draft model", "head/tail", "link", "model", "device"):
            assert label in shown, shown
        assert panel.can_focus  # the rest (histogram, sparklines) scrolls from the keyboard


def test_a_local_directory_is_opened_not_downloaded(zoo):
    """The loading bar's stage for a local model: "open", never "download"."""
    from sfchat.model.source import ModelSource

    stages = []
    ModelSource.open(str(zoo["qwen2-tied"]), progress=lambda stage, *_: stages.append(stage))
    assert stages and set(stages) == {"open"}


def test_the_kernel_hub_warning_of_bitsandbytes_is_dropped(caplog):
    """bitsandbytes logs it at import on AVX512-BF16 CPUs; replayed here through its logger."""
    import logging

    from sfchat.model.quant import _bnb

    _bnb()
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no net")
        log.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]


def test_one_shot_errors_reach_stderr_without_escape_codes(monkeypatch, capsys):
    """A tail ERROR (as the head raises it) carrying ANSI escapes: one plain line on stderr."""
    import sfchat.cli as cli
    from sfchat.node import oneshot
    from sfchat.node.driver import LinkError

    def tail_error(*args):
        raise LinkError(HOSTILE_ERROR)

    monkeypatch.setattr(oneshot, "one_shot", tail_error)
    assert cli.main(["--model", "/some/model", "--prompt", "hi"]) == cli.EXIT_LINK
    err = capsys.readouterr().err
    assert "re-enter your secret" in err and "\x1b" not in err and "\x07" not in err
    assert err.count("\n") == 1


@pilot_test
async def test_typing_in_the_history_filters_the_chats_by_their_text(db):
    history = History(db)
    for title, reply in (("cooking", "Boil the pasta."), ("travel", "Take the night TRAIN."), ("maths", "2+2=4")):
        chat = history.new_chat(title)
        history.add_message(chat, "user", title)
        history.add_message(chat, "assistant", reply)
    history.set_system(history.new_chat("poems"), "Answer in verse.")
    history.close()
    async with chat_app(FakeRuntime(), db, size=(80, 24)) as (app, pilot):
        await open_history(pilot)
        screen = app.screen

        def listed() -> list[str]:
            return [c.title for c in app.screen._chats.values()]

        assert listed() == ["poems", "maths", "travel", "cooking"]
        for ch in "train":  # typed in the list: the search takes it; a reply's text matches, any case
            await pilot.press(ch)
        await wait_for(pilot, lambda: listed() == ["travel"])
        assert screen.query_one("#history-search").value == "train"
        await pilot.press("backspace", "backspace", "backspace", "backspace", "backspace", "v", "e", "r", "s")
        await wait_for(pilot, lambda: listed() == ["poems"])  # the system prompt counts
        await pilot.press("backspace", "backspace", "backspace", "backspace", "%")  # taken literally
        await wait_for(pilot, lambda: listed() == [])
        assert "No chat contains “%”" in str(screen.query_one("#history-list").get_option_at_index(0).prompt)
        await pilot.press("backspace", "t")
        await wait_for(pilot, lambda: listed() == ["maths", "travel", "cooking"])
        await pilot.press("down", "enter")  # from the search field: Down moves in the list, Enter opens
        await wait_for(pilot, lambda: app.session.title == "travel")
        await open_history(pilot)
        await pilot.press("z")
        await wait_for(pilot, lambda: listed() == [])
        await pilot.press("escape")  # Esc empties the search first
        await wait_for(pilot, lambda: len(listed()) == 4)
        assert isinstance(app.screen, type(screen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, type(screen)))
