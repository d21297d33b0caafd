"""The live metrics side panel.

Contract: ``MetricsPanel.show(figures)`` renders a ``meter.Figures``; ``set_setup`` and
``set_link`` render what the runtime said it uses and the link's state. The panel computes
nothing itself and never reads the clock, so the same events always draw the same panel.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Sparkline, Static

from sfchat.events import RuntimeReady
from sfchat.ui.meter import Figures

BAR_CELLS = 14
BLOCKS = " ▏▎▍▌▋▊▉█"
LINK_STYLES = {
    "local": ("● local", "green"),
    "waiting": ("◌ waiting for tail", "yellow"),
    "connected": ("● connected", "green"),
    "reconnecting": ("◌ reconnecting", "yellow"),
    "stalled": ("◌ stalled", "yellow"),
    "closed": ("✖ closed", "red"),
}


def link_text(state: str, detail: str = "") -> Text:
    label, style = LINK_STYLES.get(state, (f"? {state}", "yellow"))
    text = Text(label, style=style)
    if detail:
        text.append(f" ({detail})", style="dim")
    return text


def short_model(name: str) -> str:
    """A hub id without its organisation, a path without its folders."""
    return name.rstrip("/").rsplit("/", 1)[-1]


def weights(ready: RuntimeReady) -> str:
    """The dtype in use (and the tail's, when its GPU made it differ), and the target's
    quantisation when there is one."""
    dtype = f"{ready.dtype}/{ready.tail_dtype}" if ready.tail_dtype else ready.dtype
    return dtype if ready.quant in ("", "none") else f"{dtype}+{ready.quant}"


def bar(fraction: float, cells: int = BAR_CELLS) -> str:
    """A horizontal bar ``cells`` wide, in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, fraction)) * cells * 8)
    full, rest = divmod(eighths, 8)
    return ("█" * full + (BLOCKS[rest] if rest else "")).ljust(cells)


def drafts_text(f: Figures | None, ready: RuntimeReady | None) -> str:
    """What the last round verified (a tree of its nodes, a chain of its drafts, or no drafts), and
    how deep the reply's drafts reached on average; before any round, what rounds choose from."""
    if f is None or not f.rounds:
        choices = ready.shapes if ready is not None and ready.shapes else ()
        return "auto: " + " / ".join(choices) if len(choices) > 1 else (choices[0] if choices else "–")
    shape = f"tree {f.tree_nodes}" if f.tree_nodes else f"chain {f.last_depth}" if f.last_depth else "no drafts"
    return f"{shape}, depth {_num(f.depth_mean, '.1f')}"


def flight_text(f: Figures | None) -> str:
    """Frames in flight at the last verdict, and the share of rounds sent before their verdicts."""
    if f is None or f.in_flight is None:
        return "–"
    return f"{f.in_flight} · {'–' if f.hit_rate is None else format(f.hit_rate, '.0%')} hits"


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{unit}"


def _grid(label_cells: int) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="dim", no_wrap=True, min_width=label_cells)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    return grid


class MetricsPanel(VerticalScroll, can_focus=True):
    """Side panel: speed, timings, link and setup first (they fit 24 rows), then acceptance
    histogram and sparklines; focusable (Tab), so that a terminal without a mouse scrolls it."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._ready: RuntimeReady | None = None
        self._link = link_text("waiting")

    def compose(self) -> ComposeResult:
        yield Static(id="speed")
        yield Static(id="timings")
        yield Static(id="setup")
        yield Static(id="histogram")
        yield Label("tok/s per round", classes="spark-label")
        yield Sparkline([], id="spark-tps")
        yield Label("accepted per round", classes="spark-label")
        yield Sparkline([], id="spark-accepted")

    def on_mount(self) -> None:
        self.border_title = "speculation"
        self.show(None)
        self._render_setup()

    def show(self, f: Figures | None) -> None:
        speed = _grid(12)
        speed.add_row("tok/s now", _num(f and f.tps_now, ".1f"))
        speed.add_row("tok/s mean", _num(f and f.tps_mean, ".1f"))
        speed.add_row("first token", _num(f and f.ttft_s, ".2f", " s"))
        speed.add_row("tokens/round", _num(f and f.tokens_per_round, ".2f"))
        accepted = _num(f and f.accepted_mean, ".2f")
        speed.add_row("accepted", f"{accepted} of {f.k}" if f and f.k else accepted)
        speed.add_row("drafts", drafts_text(f, self._ready))
        speed.add_row("frame", _num(f and f.forward_bytes and f.forward_bytes / 1024, ".0f", " KiB"))
        if f and f.prompt_tokens is not None:
            speed.add_row("prompt", f"{f.prompt_tokens} tok ({f.reused_tokens} cached)")
        self.query_one("#speed", Static).update(speed)

        self.query_one("#spark-tps", Sparkline).data = list(f.spark_tps) if f else []
        self.query_one("#spark-accepted", Sparkline).data = list(f.spark_accepted) if f else []

        hist = Text("accepted drafts per round\n", style="dim")
        counts = f.histogram if f else ()
        most = max(counts, default=0) or 1
        for accepted, count in enumerate(counts):
            hist.append(f"{accepted:>2} ", style="dim")
            hist.append(bar(count / most), style="green" if accepted == len(counts) - 1 else "cyan")
            hist.append(f" {count:>4}\n")
        hist.rstrip()
        self.query_one("#histogram", Static).update(hist)

        timings = _grid(11)
        timings.add_row("RTT p50/p95", f"{_num(f and f.rtt_p50_ms, '.0f')} / "
                                       f"{_num(f and f.rtt_p95_ms, '.0f')} ms")
        timings.add_row("draft/head/tail", f"{_num(f and f.draft_ms, '.0f')} / "
                                           f"{_num(f and f.head_ms, '.0f')} / "
                                           f"{_num(f and f.tail_ms, '.0f')} ms")
        timings.add_row("wait/overlap", f"{_num(f and f.wait_ms, '.0f')} / {_num(f and f.overlap_ms, '.0f')} ms")
        timings.add_row("in flight", flight_text(f))

        self.query_one("#timings", Static).update(timings)

    def set_setup(self, ready: RuntimeReady | None) -> None:
        self._ready = ready
        self._render_setup()

    def set_link(self, state: str, detail: str = "") -> None:
        self._link = link_text(state, detail)
        self._render_setup()

    def _render_setup(self) -> None:
        ready = self._ready
        setup = _grid(6)
        setup.add_row("link", self._link)
        if ready is not None:
            setup.add_row("model", short_model(ready.model))
            setup.add_row("draft", short_model(ready.draft))
            setup.add_row("split", f"{ready.split}/{ready.n_layers} · {weights(ready)} · K={ready.k}")
            setup.add_row("device", f"{ready.device} ({ready.mode})")
        self.query_one("#setup", Static).update(setup)
