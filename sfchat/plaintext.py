"""Text from the network, made safe to show: the one sanitiser of sfchat.

Contract: ``plain(text)`` returns ``text`` with ANSI/VT escape sequences (CSI, OSC, DCS and other
ESC sequences, and their 8-bit C1 forms), every other control character and the bidirectional
formatting characters (U+202A-U+202E, U+2066-U+2069, U+200E, U+200F, U+061C: they would show a
line's characters in another order than they are) removed; newlines and tabs become spaces, so
that a message stays on one line and reads in the order it was written. It does not escape markup: the
UI shows the result only through widgets and calls that take text literally (``Content(...)``,
``Text(...)``, ``notify(..., markup=False)``).

Everything a peer, the relay or a man in the middle can influence (close reasons, tail ERROR
text, relay HTTP refusal bodies, link details, runtime failure messages) goes through one of
this before the TUI or the terminal shows it. ``printable(text)`` is the same for text of many
lines (a reply written to a terminal): escape sequences and control characters removed, newlines
and tabs kept, nothing cut. Standard library only.
"""

from __future__ import annotations

import re

# ESC [ ... final, ESC ] ... (BEL | ESC \), ESC P/X/^/_ ... ESC \, two-character ESC sequences,
# and the C1 forms (0x9b CSI, 0x9d OSC, 0x90 DCS, 0x98/0x9e/0x9f strings).
_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|(?:\x1b[PX^_]|[\x90\x98\x9e\x9f])[^\x1b\x9c]*(?:\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# bidirectional overrides, embeddings, isolates and marks: they reorder what follows them on the line
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_BLANKS = re.compile(r"[\t\n\r]")
MAX_CHARS = 2000  # a message longer than this is cut: nobody reads it, and it could flood the screen


def plain(text: object) -> str:
    """``text`` without escape sequences or control characters, on one line."""
    s = _ESCAPES.sub("", str(text))
    s = _BIDI.sub("", _CONTROLS.sub("", _BLANKS.sub(" ", s)))
    return s if len(s) <= MAX_CHARS else s[:MAX_CHARS] + "…"


def printable(text: object) -> str:
    """``text`` without escape sequences or control characters; newlines and tabs stay."""
    return _CONTROLS.sub("", _ESCAPES.sub("", str(text)))


__all__ = ["plain", "printable", "MAX_CHARS"]
