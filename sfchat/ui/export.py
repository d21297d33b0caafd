"""A chat written to a Markdown file: the text, the file, and the screen that asks where.

Contract: ``chat_markdown`` renders a chat (title, system prompt, turns) as a Markdown document:
a heading, when and with which model, then each turn under "## You" or "## Assistant" (a reply
that did not end normally is marked so). Every text in it is made safe for a terminal that shows
the file (``plaintext.printable``: no escape sequence or control character; line breaks kept; the
title and the model on one line, ``plain``), as a chat's text may come from a model, a remote head
or the history file. ``default_name`` is ``sfchat-<title>-<YYYYmmdd-HHMM>.md``, its title part
letters, digits and dashes only.

``write_new(path, text)`` creates the file only if nothing is at ``path`` (``FileExistsError``
otherwise, a symbolic link included: it is never followed); ``replace(path, text)`` writes a
temporary file beside it and moves it over ``path``, so a link there is replaced, never written
through, and a failure leaves the old file whole. Both create files readable by their user only
(a chat is private) and raise ``OSError`` for what the file system refuses. Whether to replace is
the person's choice (the app asks first).

``ExportScreen(default)`` asks for the path in a field that starts with ``default`` and dismisses
with it as typed (None for Esc); a relative path is the working directory's.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from sfchat.plaintext import plain, printable

MAX_PATH_CHARS = 4096
NAME_CHARS = 40  # of the title, in a default file name
ENDINGS = {"cancelled": "*(cancelled: the reply was stopped here)*",
           "interrupted": "*(interrupted: the reply was cut off here)*"}


def chat_markdown(title: str, system: str | None, turns: Iterable, model: str = "",
                  when: float | None = None) -> str:
    """The chat as Markdown; ``turns`` have ``role``, ``content`` and ``status``."""
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() if when is None else when))
    about = f"Exported by sfchat on {stamp}" + (f", model {plain(model)}" if model else "") + "."
    parts = [f"# {plain(title) or 'sfchat chat'}", about]
    if system:
        parts += ["## System prompt", printable(system).strip()]
    for turn in turns:
        parts += ["## You" if turn.role == "user" else "## Assistant", printable(turn.content).strip() or "*(empty)*"]
        if turn.role == "assistant" and turn.status in ENDINGS:
            parts.append(ENDINGS[turn.status])
    return "\n\n".join(parts) + "\n"


def default_name(title: str, when: float | None = None) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:NAME_CHARS].strip("-") or "chat"
    return f"sfchat-{slug}-{time.strftime('%Y%m%d-%H%M', time.localtime(when))}.md"


def write_new(path: Path, text: str) -> None:
    """Create ``path`` with ``text``; FileExistsError when anything (a link too) is there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def replace(path: Path, text: str) -> None:
    """Write ``text`` beside ``path`` and move it over ``path`` (a link there is replaced)."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".sfchat-export-", suffix=".md")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


class ExportScreen(ModalScreen[str | None]):
    """Where to write the chat, asked with a default in the working directory."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Back")]

    def __init__(self, default: str) -> None:
        super().__init__()
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Export this chat to Markdown", classes="dialog-title")
            yield Static(Content(f"A relative path is in {plain(os.getcwd())}."), id="export-what")
            yield Input(self.default, max_length=MAX_PATH_CHARS, id="export-path")
            yield Label("Enter writes it (an existing file: asked first) · Esc goes back", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(event.value.strip())
