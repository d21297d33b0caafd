"""Small widgets around the chat: header line, loading progress, status line.

Contract: each widget renders what it is handed (runtime events, ``meter.Figures``) and keeps
no state beyond what it displays. Model text is shown literally, never as markup.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar, Static

from sfchat.events import LoadProgress, RuntimeReady
from sfchat.ui.meter import Figures
from sfchat.ui.metrics import has_draft, link_text, short_model, weights


class HeaderBar(Horizontal):
    """One line: what runs (model, draft, split, dtype, K) and the link state."""

    def __init__(self, title: str) -> None:
        super().__init__()
        self._title = title

    def compose(self) -> ComposeResult:
        yield Static(Text(self._title), id="header-info")
        yield Static(id="header-link")

    def set_ready(self, ready: RuntimeReady) -> None:
        info = Text()
        info.append(short_model(ready.model), style="bold")
        if ready.draft and ready.draft != "none":
            info.append(" ⇠ ", style="dim")
            info.append(short_model(ready.draft))
        else:
            info.append(" (no draft)", style="dim")
        parts = [f"split {ready.split}/{ready.n_layers}"] if ready.mode == "relay" else []
        parts.append(weights(ready))
        if has_draft(ready):
            parts.append(f"K={ready.k}")
        info.append(" · " + " · ".join(parts), style="dim")
        self.query_one("#header-info", Static).update(info)

    def set_link(self, state: str, detail: str = "") -> None:
        self.query_one("#header-link", Static).update(link_text(state, detail))

    def set_error(self, message: str) -> None:
        self.query_one("#header-info", Static).update(Text(f"✖ {message}", style="bold red"))


class LoadPanel(Vertical):
    """A progress bar per (node, stage) until the runtime is ready."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._rows: dict[tuple[str, str], Horizontal] = {}

    def on_mount(self) -> None:
        self.border_title = "loading"

    async def progress(self, event: LoadProgress) -> None:
        key = (event.node, event.stage)
        row = self._rows.get(key)
        if row is None:
            row = Horizontal(
                Label(Text(f"{event.node} {event.stage}"), classes="load-stage"),
                ProgressBar(show_eta=False, classes="load-bar"),
                Label(classes="load-detail"),
                classes="load-row",
            )
            self._rows[key] = row
            await self.mount(row)
        # A total of 0 means "unknown": an indeterminate bar rather than a stuck one.
        total = event.total if event.total > 0 else None
        row.query_one(ProgressBar).update(total=total, progress=event.done)
        row.query_one(".load-detail", Label).update(Text(event.detail))


def status_text(state: str, figures: Figures | None, width: int | None = None, relay: bool = False) -> Text:
    """The line above the prompt: what the app is doing, and the reply's speed in short.

    It repeats the panel's main figures so that they stay visible when the panel is hidden (the
    network round trip only in ``relay`` mode, tokens per round only with a draft); given a
    ``width``, it keeps only the figures that fit whole (never half a figure).
    """
    labels = {
        "loading": ("loading…", "yellow"),
        "ready": ("ready", "green"),
        "waiting": ("prefilling… Esc cancels", "yellow"),
        "streaming": ("generating… Esc cancels", "cyan"),
        "failed": ("runtime failed", "red"),
    }
    label, style = labels.get(state, (state, ""))
    text = Text(label, style=style)
    if figures is not None and figures.rounds and state in ("ready", "streaming"):
        tps = figures.tps_now if state == "streaming" else figures.tps_mean
        parts = [f"{figures.tokens} tok"]
        if tps is not None:
            parts.append(f"{tps:.1f} tok/s")
        if figures.tokens_per_round is not None and figures.k:
            parts.append(f"{figures.tokens_per_round:.2f} tok/round")
        if figures.rtt_p50_ms is not None and relay:
            parts.append(f"RTT {figures.rtt_p50_ms:.0f} ms")
        while parts and width is not None and len(label) + 2 + len(" · ".join(parts)) > width:
            parts.pop()
        if parts:
            text.append("  " + " · ".join(parts), style="dim")
    return text
