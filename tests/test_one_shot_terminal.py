"""One-shot mode writes the reply, every token of which the tail chose, as plain text when stdout
is a terminal (round four: it went out raw), and as it is when stdout is a file or a pipe."""

from __future__ import annotations

import dataclasses
import io

import pytest

from sfchat.config import Settings
from sfchat.events import TokensCommitted
from sfchat.node import oneshot
from sfchat.node.head import Head

HOSTILE = "line one\n\x1b]0;owned\x07\x1b[2J\ttabbed\x9b31m red\r\n"


class Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_a_reply_reaches_a_terminal_as_plain_text(zoo, monkeypatch, tty):
    ask = Head.ask

    def hostile_ask(self, *args, **kwargs):  # a tail choosing the tokens of an escape sequence
        for ev in ask(self, *args, **kwargs):
            yield dataclasses.replace(ev, text=HOSTILE) if isinstance(ev, TokensCommitted) else ev

    monkeypatch.setattr(Head, "ask", hostile_ask)
    out = Terminal(tty)
    monkeypatch.setattr("sys.stdout", out)
    s = Settings(model=str(zoo["qwen2-untied"]), draft="none", k=0, device="cpu", max_new_tokens=2, max_context=128)
    assert oneshot.one_shot(s, "hi", as_json=False) == 0
    text = out.getvalue()
    if tty:
        assert "line one\n" in text and "\ttabbed" in text and " red\n" in text
        assert not any(ch in text for ch in "\x1b\x07\x9b\r")
    else:
        assert HOSTILE in text  # a file or a pipe gets the reply byte for byte
