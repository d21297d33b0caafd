"""The chat transcript: prompts, streaming Markdown replies and notices.

Contract: ``ChatView`` shows what it is told and owns no conversation state; ``note(slot,
text)`` keeps at most one notice per slot (a new text replaces it, None removes it: "waiting for
a tail" until it comes, the queued message until it is sent). A streaming
``ReplyMessage`` buffers the text it is given and renders it only when ``flush`` is called
(the app does that on a ~15 Hz timer), because re-parsing Markdown once per token would be
the slowest part of the whole chat on a fast link. At most one ``Markdown.append`` is in flight:
a tick that finds the previous one still rendering leaves the text queued for the next tick,
so a slow terminal gets fewer, larger updates instead of a growing backlog. Text from the model
or the user is always shown literally: it never passes through Textual markup. A reply's links
open nothing by themselves: a click is the app's to decide (``actions``). ``set_system`` shows the first line of the
chat's own system prompt above the turns (made plain: it comes from the history file).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Markdown, Static

from sfchat.plaintext import plain

SYSTEM_CHARS = 160  # of the system prompt's first line, shown above the turns

# How a reply that did not end normally is marked, after its text.
STATUS_MARKS = {"cancelled": "[cancelled]", "interrupted": "[interrupted]"}
FINISH_NOTES = {
    "length": "stopped at the max_new_tokens limit",
    "context": "context window full",
}


class UserMessage(Static):
    """A prompt as the user typed it."""

    def __init__(self, text: str) -> None:
        super().__init__(Content(text))


class Notice(Static):
    """A line from the application itself: loading, errors, context exhausted."""

    def __init__(self, text: str, severity: str = "information") -> None:
        super().__init__(Content(text), classes=f"-{severity}")


class ReplyMessage(Vertical):
    """One assistant reply; streams while ``status`` is "streaming"."""

    def __init__(self, text: str = "", status: str = "streaming") -> None:
        super().__init__(classes=f"-{status}")
        self.status = status
        self._initial = text
        self._pending: list[str] = []
        self._rendering: AwaitComplete | None = None

    def compose(self) -> ComposeResult:
        yield Markdown(self._initial, open_links=False)  # the app decides (ui.actions): http(s), after asking
        yield Static(classes="reply-info")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def append(self, text: str) -> None:
        """Queue text for the next ``flush``."""
        self._pending.append(text)

    def flush(self) -> None:
        """Start rendering the queued text, unless the previous render is still running."""
        if not self._pending or (self._rendering is not None and not self._rendering.is_done):
            return
        chunk = "".join(self._pending)
        self._pending.clear()
        # Markdown.append re-parses only the last block; it runs as a task of its own.
        self._rendering = self.markdown.append(chunk)

    def set_info(self, text: str) -> None:
        self._show_info(Content(text))

    def _show_info(self, content: Content) -> None:
        info = self.query_one(".reply-info", Static)
        info.update(content)
        info.display = bool(content)

    async def finish(self, text: str, status: str, info: str = "") -> None:
        """Show the final text, exactly as given, and how the reply ended."""
        self._pending.clear()
        if self._rendering is not None:
            await self._rendering
            self._rendering = None
        shown = self.markdown.source
        if text.startswith(shown):
            if text != shown:
                await self.markdown.append(text[len(shown):])
        else:
            await self.markdown.update(text)
        self.set_status(status, info)

    def set_status(self, status: str, info: str = "") -> None:
        self.remove_class(f"-{self.status}")
        self.status = status
        self.add_class(f"-{status}")
        mark = STATUS_MARKS.get(status)
        parts: list[str | tuple[str, str]] = []
        if mark:
            parts.append((mark, "bold $warning"))
        if info:
            parts.extend(["  " if mark else "", info])
        self._show_info(Content.assemble(*parts))


def reply_summary(stats: dict | None) -> str:
    """One line under a finished reply: its size and speed."""
    if not stats:
        return ""
    parts = [f"{stats.get('tokens', 0)} tokens"]
    if stats.get("tps"):
        parts.append(f"{stats['tps']:.1f} tok/s")
    if stats.get("tokens_per_round") and len(stats.get("accepted_histogram") or ()) > 1:  # only with a draft
        parts.append(f"{stats['tokens_per_round']:.2f} tok/round")
    note = FINISH_NOTES.get(stats.get("finish_reason", ""))
    if note:
        parts.append(note)
    return " · ".join(parts)


def dropped_notice(turns: int, max_context: int | None) -> str:
    """The one-line notice of a prompt that left the conversation's oldest ``turns`` out."""
    window = f" ({max_context} tokens)" if max_context else ""
    what = "turn is" if turns == 1 else "turns are"
    return f"The conversation is longer than the context window{window}: its oldest {turns} {what} left out."


class ChatView(VerticalScroll, can_focus=False):
    """The scrolling transcript; sticks to the bottom while new text arrives."""

    EMPTY_TEXT = ("Type a message below. Enter sends · Ctrl+J for a newline · Up/Down recall "
                  "earlier prompts · F1 explains the keys and the figures.")

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._notes: dict[str, Notice] = {}

    def compose(self) -> ComposeResult:
        yield Static(Content(self.EMPTY_TEXT), id="empty-hint")

    def on_mount(self) -> None:
        self.anchor()

    async def clear(self) -> None:
        self._notes.clear()
        await self.remove_children()
        await self.mount(Static(Content(self.EMPTY_TEXT), id="empty-hint"))
        self.anchor()

    async def _add(self, widget: Widget, before: Widget | None = None) -> None:
        await self.remove_children("#empty-hint")
        await self.mount(widget, before=before if before is not None and before.parent is self else None)
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        widget = UserMessage(text)
        await self._add(widget)
        return widget

    async def add_reply(self, text: str = "", status: str = "streaming",
                        info: str = "") -> ReplyMessage:
        widget = ReplyMessage(text, status)
        await self._add(widget)
        if status != "streaming" or info:
            widget.set_status(status, info)
        return widget

    async def set_system(self, system: str | None) -> None:
        """Show the first line of the chat's own system prompt above the turns; None: none."""
        await self.remove_children("#system-line")
        if not system:
            return
        lines = [s for s in system.splitlines() if s.strip()]
        first = plain(lines[0].strip()) if lines else ""
        shown = first[:SYSTEM_CHARS] + ("…" if len(lines) > 1 or len(first) > SYSTEM_CHARS else "")
        line = Static(Content.assemble(("system prompt: ", "bold"), shown), id="system-line")
        await self.mount(line, before=0 if self.children else None)

    async def add_notice(self, text: str, severity: str = "information", before: Widget | None = None) -> Notice:
        """A notice at the end of the transcript, or just above ``before`` (a reply it concerns)."""
        widget = Notice(text, severity)
        await self._add(widget, before)
        return widget

    async def note(self, slot: str, text: str | None) -> None:
        """Show ``text`` as the one notice of ``slot`` (replacing the last one); None removes it."""
        old = self._notes.pop(slot, None)
        if old is not None:
            await old.remove()
        if text is not None:
            self._notes[slot] = await self.add_notice(text)
