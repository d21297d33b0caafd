"""The history screen: pick an earlier chat to reopen, or delete one.

Contract: ``HistoryScreen`` lists ``History.list_chats()`` and dismisses with the chosen
``ChatSummary`` (None when closed with Esc). Opening the chat is the app's business; deleting
is done here, as it concerns only the list (the chat that is open cannot be deleted).
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Label, OptionList
from textual.widgets.option_list import Option

from sfchat.history import ChatSummary, History


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


class HistoryScreen(ModalScreen[ChatSummary | None]):
    """Modal list of stored chats, newest first."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Back"),
        Binding("delete", "delete", "Delete chat"),
    ]

    def __init__(self, history: History, open_chat_id: int | None = None) -> None:
        super().__init__()
        self.history = history
        self.open_chat_id = open_chat_id
        self._chats: dict[str, ChatSummary] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="history-box"):
            yield Label("Chats — Enter opens, Delete removes, Esc goes back", id="history-title")
            yield OptionList(id="history-list")
        yield Footer()

    def on_mount(self) -> None:
        self._refill()
        self.query_one(OptionList).focus()

    def _refill(self) -> None:
        chats = self.history.list_chats()
        self._chats = {str(c.id): c for c in chats}
        options = self.query_one(OptionList)
        options.clear_options()
        for n, chat in enumerate(chats):
            if n:
                options.add_option(None)  # a rule between chats
            line = Text(chat.title, style="bold")
            line.append(f"\n{_when(chat.updated_at)} · {chat.n_messages} messages", style="dim")
            if chat.model:
                line.append(f" · {chat.model}", style="dim")
            options.add_option(Option(line, id=str(chat.id)))
        if not chats:
            options.add_option(Option(Text("No chats yet.", style="dim"), disabled=True))
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
        self.history.delete_chat(chosen.id)
        self.notify(f"Deleted “{chosen.title}”")
        self._refill()
