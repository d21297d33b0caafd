"""The help screen: sfchat's keys, and what each figure of the metrics panel means.

Contract: ``HelpScreen(section)`` is a modal over the chat, opened by F1 and from the command
palette ("Keys", "Metrics explained"); it shows ``KEYS``, then the panel's figures (from
``metrics``, with their explanations) grouped by the setup they need, then its graphs. It starts
at ``section`` ("keys" or "figures"), scrolls from the keyboard and closes with Esc, F1 or q. It
fills at most the screen, so it fits 80x24. It knows nothing of the runtime and keeps no state.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Label, Static

from sfchat.ui.metrics import GRAPHS, SETUP, SPEED, TIMINGS

KEYS = (
    ("Enter", "send the message (while a reply is written: queued, sent when it ends)"),
    ("Ctrl+J", "a new line in the message"),
    ("Up / Down", "earlier messages, from the first / last line of the editor"),
    ("Esc", "stop the reply (what was written is kept, marked cancelled)"),
    ("Ctrl+N", "new chat"),
    ("F2, Ctrl+R", "history: reopen or delete an earlier chat; type there to search the chats"),
    ("F3", "show or hide the metrics panel"),
    ("F1", "this help"),
    ("Tab", "move to the metrics panel (Up / Down scroll it) and back"),
    ("Ctrl+Y", "copy the last reply"),
    ("Ctrl+G", "regenerate: make the last reply again, in place of the one shown"),
    ("F4", "edit your last message (again: the one before); Enter sends it in its place, Esc keeps it"),
    ("F5", "this chat's own system prompt (empty: the default, --system)"),
    ("Ctrl+S", "export this chat to a Markdown file (asks where; never replaces a file unasked)"),
    ("Ctrl+P", "command palette: every action by its name"),
    ("Ctrl+Q", "quit"),
)
ROUND = ("How it works: a small draft model guesses the next few tokens; the big model checks them all "
         "in one pass (a round), keeps the guesses it agrees with and adds one token of its own. Over two "
         "machines the big model is split: the first layers (the head) run here, the rest (the tail) on "
         "the other machine.")
LABEL_CELLS = 12  # the panel's longest row label
GROUPS = (
    ("", "Always"),
    ("draft", "With a draft model"),
    ("relay", "With two machines (relay mode)"),
    ("relay+draft", "With two machines and a draft model"),
)


def _table(rows, label_cells: int = 0) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True, min_width=label_cells)
    table.add_column(overflow="fold")
    for name, what in rows:
        table.add_row(Text(name), Text(what))
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,f1,q", "dismiss(None)", "Close"),
    ]

    def __init__(self, section: str = "keys") -> None:
        super().__init__()
        self.section = section

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Label("Keys", classes="help-heading", id="help-keys")
            yield Static(_table(KEYS))
            yield Label("The metrics panel", classes="help-heading", id="help-figures")
            yield Static(Text(ROUND), classes="help-intro")
            for needs, title in GROUPS:
                yield Label(title, classes="help-group")
                yield Static(_table(((f.label, f.help) for f in SPEED + TIMINGS + SETUP if f.needs == needs),
                                    LABEL_CELLS))
            yield Label("Graphs, below the figures (Tab, then Down, scrolls the panel)", classes="help-group")
            yield Static(_table((f.label, f.help + (" (with a draft model)" if f.needs else "")) for f in GRAPHS))
        yield Footer()

    def on_mount(self) -> None:
        box = self.query_one("#help-box", VerticalScroll)
        box.border_title = "help"
        box.focus()
        if self.section == "figures":
            self.call_after_refresh(box.scroll_to_widget, self.query_one("#help-figures"), top=True,
                                    animate=False)
