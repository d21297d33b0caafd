"""The modal screens over the chat: the history, a yes/no question, the pairing code.

Contract: ``HistoryScreen`` lists ``History.list_chats()`` and dismisses with the chosen
``ChatSummary`` (None when closed with Esc, or when the history file fails: said in an error
notification). Typing filters the list: the search field takes every printable key typed in the
list, and keeps the chats whose title, system prompt or messages contain it (``list_chats(query)``);
Up, Down and Enter still move in the list and open, and Esc empties a search before it closes. Opening the chat is the app's business; deleting
is done here, as it concerns only the list (the chat that is open cannot be deleted), and only
after ``ConfirmScreen`` got a "y": a deleted chat cannot be brought back.

``ConfirmScreen(question)`` dismisses with True for "y", False for "n" or Esc.

``SystemScreen(current, default)`` edits a chat's own system prompt in a multi-line editor (Enter
keeps it, Ctrl+J is a newline, as in the prompt editor) and dismisses with the text (blank: none of
its own, ``default`` applies), or None for Esc (nothing changes). ``default`` (``--system``, which
may come from a config file) is shown as plain text.

``CodeScreen(reason)`` asks for the pairing code in a masked field, with ``reason`` (which may
come from the network) as plain text, and dismisses with the code typed; it cannot be dismissed
empty (Ctrl+Q still quits). ``ask_again(reason)`` shows a new reason and empties the field.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from sfchat.history import QUERY_CHARS, ChatSummary, History, HistoryError
from sfchat.plaintext import plain
from sfchat.ui.metrics import short_model
from sfchat.ui.prompt import PromptInput


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


class HistoryScreen(ModalScreen[ChatSummary | None]):
    """Modal list of stored chats, newest first."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("delete", "delete", "Delete chat"),
        # from the search field: the list's own keys, which it has no use for
        Binding("up", "move('cursor_up')", show=False),
        Binding("down", "move('cursor_down')", show=False),
    ]

    def __init__(self, history: History, open_chat_id: int | None = None) -> None:
        super().__init__()
        self.history = history
        self.open_chat_id = open_chat_id
        self._chats: dict[str, ChatSummary] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="history-box"):
            yield Label("Chats — type to search, Enter opens, Delete removes, Esc back", id="history-title")
            yield Input(placeholder="search titles and messages", max_length=QUERY_CHARS, select_on_focus=False,
                        id="history-search")
            yield OptionList(id="history-list")
        yield Footer()

    @property
    def query_text(self) -> str:
        return self.query_one("#history-search", Input).value

    def on_key(self, event: events.Key) -> None:
        """A key typed in the list that a search takes goes to the search field."""
        search = self.query_one("#history-search", Input)
        if search.has_focus or not (event.is_printable or event.key == "backspace"):
            return
        event.stop()
        search.focus()
        if event.key == "backspace":
            search.action_delete_left()
        elif event.character:
            search.insert_text_at_cursor(event.character)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        try:
            self._refill()
        except HistoryError as exc:
            self.notify(str(exc), title="history", severity="error", markup=False)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        chosen = self._highlighted()
        if chosen is not None:
            self.dismiss(chosen)

    def action_move(self, action: str) -> None:
        getattr(self.query_one(OptionList), f"action_{action}")()

    def action_back(self) -> None:
        if self.query_text:
            self.query_one("#history-search", Input).clear()
            self.query_one(OptionList).focus()
        else:
            self.dismiss(None)

    def on_mount(self) -> None:
        try:
            self._refill()
        except HistoryError as exc:  # the file went bad since sfchat opened it
            self.notify(str(exc), title="history", severity="error", markup=False)
            self.dismiss(None)
            return
        self.query_one(OptionList).focus()

    def _refill(self) -> None:
        chats = self.history.list_chats(query=self.query_text)
        self._chats = {str(c.id): c for c in chats}
        options = self.query_one(OptionList)
        options.clear_options()
        for n, chat in enumerate(chats):
            if n:
                options.add_option(None)  # a rule between chats
            line = Text(chat.title, style="bold")
            count = chat.n_messages
            line.append(f"\n{_when(chat.updated_at)} · {count} message{'' if count == 1 else 's'}", style="dim")
            if chat.model:
                line.append(f" · {short_model(chat.model)}", style="dim")  # a name, not a path
            options.add_option(Option(line, id=str(chat.id)))
        if not chats:
            none = f"No chat contains “{self.query_text.strip()}”." if self.query_text.strip() else "No chats yet."
            options.add_option(Option(Text(none, style="dim"), disabled=True))
        elif options.highlighted is None:
            options.highlighted = 0

    def _highlighted(self) -> ChatSummary | None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return None
        return self._chats.get(options.get_option_at_index(options.highlighted).id or "")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(self._chats.get(event.option.id or ""))

    def action_delete(self) -> None:
        chosen = self._highlighted()
        if chosen is None:
            return
        if chosen.id == self.open_chat_id:
            self.notify("That chat is open: start a new chat (Ctrl+N) before deleting it.",
                        severity="warning")
            return
        n = chosen.n_messages
        question = (f"Delete the chat “{chosen.title}” ({n} message{'' if n == 1 else 's'})? "
                    "It cannot be brought back.")

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            try:
                self.history.delete_chat(chosen.id)
                self._refill()
            except HistoryError as exc:
                self.notify(str(exc), title="history", severity="error", markup=False)
                return
            self.notify(f"Deleted “{chosen.title}”", markup=False)

        self.app.push_screen(ConfirmScreen(question), answered)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; only "y" says yes."""

    BINDINGS = [
        Binding("y", "dismiss(True)", "Yes"),
        Binding("n,escape", "dismiss(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(Content(self.question))
            yield Label("y: yes · n or Esc: no", classes="dialog-hint")
        yield Footer()


class SystemScreen(ModalScreen[str | None]):
    """The open chat's own system prompt, edited."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Back")]

    def __init__(self, current: str | None, default: str | None) -> None:
        super().__init__()
        self.current, self.default = current or "", default

    def compose(self) -> ComposeResult:
        default = f"the default: {plain(self.default)}" if self.default else "the head's own default"
        with Vertical(classes="dialog"):
            yield Label("System prompt of this chat", classes="dialog-title")
            yield Static(Content(f"Left empty, {default}."), id="system-default")
            yield PromptInput(id="system-input", placeholder="how the model should behave in this chat")
            yield Label("Enter keeps it · Ctrl+J newline · Esc goes back", classes="dialog-hint")

    def on_mount(self) -> None:
        editor = self.query_one(PromptInput)
        editor.load_text(self.current)
        editor.move_cursor(editor.document.end)
        editor.focus()

    def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        self.dismiss(event.text.strip())


class CodeScreen(ModalScreen[str]):
    """The pairing code, asked for in a masked field."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Pairing code", classes="dialog-title")
            yield Static(Content(self.reason), id="code-reason")
            yield Input(password=True, placeholder="the code, as the other machine printed it", id="code-input")
            yield Label("Enter pairs · Ctrl+Q quits", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def ask_again(self, reason: str) -> None:
        self.reason = reason
        self.query_one("#code-reason", Static).update(Content(reason))
        self.query_one(Input).clear()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(event.value.strip())
