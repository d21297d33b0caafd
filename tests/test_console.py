"""The download line of one-shot mode and ``--serve``: a file name the tail reported is plain text."""

from __future__ import annotations

import io
import sys

from sfchat.console import show_download
from sfchat.events import LoadProgress

HOSTILE = "\x1b]0;owned\x07\x1b[2J\x9b31mmodel-00001-of-00002.safetensors\x1b[0m"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_reported_file_name_reaches_the_terminal_as_plain_text(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    show_download(LoadProgress(node="tail\x1b[8m", stage="download", done=3 << 20, total=8 << 20, detail=HOSTILE))
    line = screen.getvalue()
    assert line.startswith("\r\x1b[K")  # sfchat's own: back to the start of the line, cleared
    assert "sfchat: tail downloading model-00001-of-00002.safetensors [" in line and line.endswith("3/8 MiB")
    assert not any(ch in line[len("\r\x1b[K"):] for ch in "\x1b\x07\x9b")


def test_nothing_is_drawn_off_a_terminal(monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    show_download(LoadProgress(node="tail", stage="download", done=1, total=8, detail="x"))
    assert screen.getvalue() == ""
