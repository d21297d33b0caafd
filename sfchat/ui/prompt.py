"""The multi-line prompt editor.

Contract: ``PromptInput`` is a ``TextArea`` where Enter posts ``PromptInput.Submitted`` (and
does not insert a newline), Ctrl+J inserts one, and Up on the first line / Down on the last line
walk through earlier prompts like a shell. Shift+Enter and Alt+Enter insert a newline too, but
only in terminals that report them (the kitty keyboard protocol: kitty, WezTerm, foot, Ghostty);
others (xterm, tmux, a notebook's terminal) send them as a bare Enter, which sends the message.
So the hints promise Ctrl+J only. Whether a prompt may be sent is the app's decision, not the
editor's.
"""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

RECALL_LIMIT = 200


class PromptInput(TextArea):
    """Prompt editor with Enter-to-send and prompt recall."""

    BINDINGS = [
        Binding("shift+enter,alt+enter,ctrl+j", "newline", "Newline", show=False),
    ]

    class Submitted(Message):
        """The user pressed Enter; ``text`` is the whole prompt."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None, placeholder: str = "") -> None:
        super().__init__(id=id, placeholder=placeholder, soft_wrap=True,
                         show_line_numbers=False, tab_behavior="focus",
                         highlight_cursor_line=False)
        self._recall: list[str] = []
        self._recall_at: int | None = None  # index into _recall while browsing, else None
        self._draft = ""

    def remember(self, prompts: list[str] | str) -> None:
        """Add prompts (oldest first) to what Up can recall."""
        for prompt in [prompts] if isinstance(prompts, str) else prompts:
            if prompt.strip() and (not self._recall or self._recall[-1] != prompt):
                self._recall.append(prompt)
        del self._recall[:-RECALL_LIMIT]
        self._recall_at = None

    async def _on_key(self, event: events.Key) -> None:
        # Runs before TextArea's own handler, which would insert a newline for Enter.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))

    def action_newline(self) -> None:
        if not self.read_only:
            self.replace("\n", *self.selection, maintain_selection_offset=False)

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_at_first_line and self._step_recall(-1):
            return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if not select and self.cursor_at_last_line and self._step_recall(+1):
            return
        super().action_cursor_down(select)

    def _step_recall(self, step: int) -> bool:
        """Show the previous (-1) or next (+1) remembered prompt; False if there is none."""
        if self._recall_at is None:
            if step > 0 or not self._recall:
                return False
            self._draft = self.text
            at = len(self._recall) - 1
        else:
            at = self._recall_at + step
            if at < 0:
                return False
        if at >= len(self._recall):
            self._recall_at = None
            self._show(self._draft)
        else:
            self._recall_at = at
            self._show(self._recall[at])
        return True

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
