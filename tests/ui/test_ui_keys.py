"""The keys the README and the chat screen promise do what they say in a plain terminal, and the
palette's "Keys" entry shows sfchat's keys in a view that fits 80x24 and closes with Esc.

A key is typed as the bytes a plain xterm (or tmux, or a notebook's terminal) sends for it, and
those bytes go through Textual's own input parser: so Alt+Enter arrives as ESC CR, Ctrl+H as
BS, as they do in the terminals where the user presses them.
"""

from __future__ import annotations

import re
from pathlib import Path

from textual._xterm_parser import XTermParser

from sfchat.ui.chat import ChatView
from sfchat.ui.prompt import PromptInput

from pilots import FakeRuntime, chat_app, db, pilot_test, wait_for  # noqa: F401

README = Path(__file__).parents[2] / "README.md"
KEY = re.compile(r"\b(?:(?:Ctrl|Alt|Shift)\+(?:Enter|[A-Z])|F\d{1,2})\b")
# what a plain xterm sends for each key (no kitty keyboard protocol)
PLAIN = {"Enter": "\r", "Shift+Enter": "\r", "Alt+Enter": "\x1b\r", "Ctrl+J": "\n", "Ctrl+H": "\x08",
         "Ctrl+R": "\x12", "F1": "\x1bOP", "F2": "\x1bOQ", "F3": "\x1bOR"}
# and a terminal that speaks the kitty keyboard protocol, which Textual turns on
KITTY = {"Shift+Enter": "\x1b[13;2u", "Alt+Enter": "\x1b[13;3u"}


def keys_of(sequence: str) -> list[str]:
    """The Textual key names the terminal's bytes become."""
    parser = XTermParser()
    return [e.key for e in [*parser.feed(sequence), *parser.feed("")] if hasattr(e, "key")]


def chat_screen_table() -> list[tuple[str, str]]:
    """(key cell, action cell) of each row of the README's key table under "The chat screen"."""
    section = README.read_text().split("## The chat screen", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("| ---")]
    return [(row[0], row[1]) for row in rows[1:]]


def promised(for_what: str, hints: list[str]) -> set[str]:
    """Every key named for ``for_what`` by the README's table or by one " · " part of a hint."""
    named = {k for cell, action in chat_screen_table() if for_what in action for k in KEY.findall(cell)}
    for hint in hints:
        named |= {k for part in hint.split("·") if for_what in part for k in KEY.findall(part)}
    return named


@pilot_test
async def test_every_documented_newline_and_history_key_works_in_a_plain_terminal(db):
    runtime = FakeRuntime()
    async with chat_app(runtime, db) as (app, pilot):
        prompt = app.query_one(PromptInput)
        hints = [ChatView.EMPTY_TEXT, str(prompt.placeholder)]
        newline, history = promised("newline", hints), promised("history", hints)
        assert "Ctrl+J" in newline and "F2" in history, (newline, history)
        tried = [(key, PLAIN[key]) for key in sorted(newline)] + [(k, s) for k, s in KITTY.items()]
        for key, sequence in tried:
            prompt.clear()
            await pilot.press("a", *keys_of(sequence), "b")
            assert prompt.text == "a\nb" and not runtime.submitted, (key, keys_of(sequence), prompt.text)
        prompt.clear()
        main = app.screen
        for key in sorted(history):
            await pilot.press(*keys_of(PLAIN[key]))
            await pilot.pause(0.1)
            assert type(app.screen).__name__ == "HistoryScreen", (key, keys_of(PLAIN[key]))
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen is main)


@pilot_test
async def test_the_palettes_keys_entry_shows_sfchats_keys_fits_80x24_and_esc_closes_it(db):
    async with chat_app(FakeRuntime(), db, size=(80, 24)) as (app, pilot):
        main = app.screen
        await pilot.press("ctrl+p")
        await pilot.pause(0.2)
        for ch in "Keys":
            await pilot.press(ch)
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is not main and "Command" not in type(app.screen).__name__)
        await pilot.pause(0.2)
        lines = [strip.text for strip in app.screen._compositor.render_strips()]
        shown = "\n".join(lines)
        for key, what in (("Ctrl+N", "new chat"), ("Ctrl+R", "history"), ("F3", "metrics panel"),
                          ("Esc", "stop the reply"), ("Ctrl+J", "new line"), ("Ctrl+G", "regenerate"),
                          ("F4", "edit your last message"), ("F5", "system prompt"), ("Ctrl+S", "export")):
            assert re.search(rf"{re.escape(key)}\s.*{what}", shown), (key, shown)
        box = app.screen.query_one("#help-box")
        assert box.region.width >= 78 and box.region.bottom <= 23, box.region  # not squeezed, above the footer
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is main)
        assert not main.query("HelpPanel")
        chat = app.query_one(ChatView)
        assert chat.region.width >= 78  # the chat keeps the whole width
