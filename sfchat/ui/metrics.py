"""The live metrics side panel, and what each of its figures means.

Contract: ``MetricsPanel.show(figures)`` renders a ``meter.Figures``; ``set_setup`` and
``set_link`` render what the runtime said it uses and the link's state. The panel computes
nothing itself and never reads the clock, so the same events always draw the same panel.

Rows that do not apply stay hidden: without a draft model there is no acceptance, round shape,
draft time or histogram; in local mode (one process) no network round trip, frame size, wait or
rounds in flight. Before the runtime is ready only the rows every setup has are shown. ``SPEED``, ``TIMINGS``,
``SETUP`` and ``GRAPHS`` name every row the panel can show with a one-line explanation (the help
screen lists them) and ``needs``: "draft", "relay" or both where the row needs that setup. Values wrap rather than being cut:
at 80x24 every row fits the panel whole.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Figure:
    label: str
    help: str
    needs: str = ""  # "draft", "relay", or "" for every setup


SPEED = (
    Figure("tok/s now", "speed of the reply over its last few rounds, in tokens (word pieces) per second"),
    Figure("tok/s mean", "speed over the whole reply, not counting its first round (which reads the prompt)"),
    Figure("first token", "seconds from sending the message until the first word of the reply"),
    Figure("tokens/round", "tokens the reply grows by per round (one check by the big model); more is faster",
           "draft"),
    Figure("accepted", "guessed tokens per round that the big model agreed with, of the most the draft may guess",
           "draft"),
    Figure("drafts", "what a round asks the big model to check (a chain of guesses or a tree of alternatives) "
           "and how deep the guesses reached", "draft"),
    Figure("sent/round", "data this machine sends to the tail machine per round", "relay"),
    Figure("prompt", "tokens the model read for this reply, and how many it still held from the turn before"),
)
TIMINGS = (
    Figure("RTT p50/p95", "network round trip to the tail machine and back: typical / the slowest 1 in 20 rounds",
           "relay"),
    Figure("draft model", "milliseconds per round the small draft model spends guessing", "draft"),
    Figure("head/tail", "milliseconds per round for the big model's first layers (the head, on this machine) / "
           "the other layers (the tail)"),
    Figure("wait/overlap", "milliseconds per round spent waiting for the tail's answer / preparing the next "
           "round meanwhile", "relay"),
    Figure("in flight", "rounds sent before the answer to the one before came back, and how often that guess "
           "held", "relay+draft"),
)
SETUP = (
    Figure("link", "the connection to the tail: local (all in this process), waiting, connected, stalled or "
           "reconnecting"),
    Figure("model", "the big model that writes the reply"),
    Figure("draft", "the small model that guesses tokens for the big one to check (none: every token is "
           "computed by the big model alone)"),
    Figure("split", "layers on this machine / all the model's layers (the tail machine runs the rest), then what "
           "the weights row says", "relay"),
    Figure("weights", "the number format of the weights (bf16, fp16, fp32; +nf4: 4-bit; the tail's after a / "
           "where it differs); K: the most tokens the draft guesses per round"),
    Figure("device", "where this machine computes, and the mode: local (one machine) or relay (two)"),
)
GRAPHS = (
    Figure("accepted drafts per round", "how many rounds had 0, 1, ... guesses accepted: long bars at the "
           "bottom mean a good draft", "draft"),
    Figure("tok/s per round", "the speed of each recent round, newest on the right"),
    Figure("accepted per round", "the accepted guesses of each recent round, newest on the right", "draft"),
)


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


def has_draft(ready: RuntimeReady | None) -> bool:
    return ready is not None and ready.k > 0 and ready.draft != "none"


def applies(figure: Figure, ready: RuntimeReady | None) -> bool:
    """Whether the row means something in this setup (nothing setup-specific before it is known)."""
    if figure.needs == "relay+draft":
        return has_draft(ready) and ready.mode == "relay"
    if figure.needs == "draft":
        return has_draft(ready)
    if figure.needs == "relay":
        return ready is not None and ready.mode == "relay"
    return True


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
    # a frame holds the committed context's next node and the drafts below it; one whose nodes lie
    # in a line, each one deeper, is a chain (the driver sends every frame as a tree of its nodes)
    drafts = f.tree_nodes - 1
    if drafts <= 0:
        return "no drafts"
    if f.tree_nodes == f.last_depth:
        return f"chain {drafts}"
    return f"tree {drafts}, depth {_num(f.depth_mean, '.1f')}"


def flight_text(f: Figures | None) -> str:
    """Frames in flight at the last verdict, and the share of rounds sent before their verdicts."""
    if f is None or f.in_flight is None:
        return "–"
    return f"{f.in_flight} · {'–' if f.hit_rate is None else format(f.hit_rate, '.0%')} held"


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{unit}"


def _pair(a: float | None, b: float | None) -> str:
    return f"{_num(a, '.0f')} / {_num(b, '.0f')} ms"


def speed_values(f: Figures | None, ready: RuntimeReady | None) -> dict[str, str]:
    """The value of every speed and timing row, by label (shown only where the row applies)."""
    accepted = _num(f and f.accepted_mean, ".2f")
    values = {
        "tok/s now": _num(f and f.tps_now, ".1f"),
        "tok/s mean": _num(f and f.tps_mean, ".1f"),
        "first token": _num(f and f.ttft_s, ".2f", " s"),
        "tokens/round": _num(f and f.tokens_per_round, ".2f"),
        "accepted": f"{accepted} of {f.k}" if f and f.k else accepted,
        "drafts": drafts_text(f, ready),
        "sent/round": _num(f and f.forward_bytes and f.forward_bytes / 1024, ".0f", " KiB"),
        "RTT p50/p95": _pair(f and f.rtt_p50_ms, f and f.rtt_p95_ms),
        "draft model": _num(f and f.draft_ms, ".0f", " ms"),
        "head/tail": _pair(f and f.head_ms, f and f.tail_ms),
        "wait/overlap": _pair(f and f.wait_ms, f and f.overlap_ms),
        "in flight": flight_text(f),
    }
    if f and f.prompt_tokens is not None:
        values["prompt"] = f"{f.prompt_tokens} ({f.reused_tokens} cached)"
    return values


def _grid(label_cells: int) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="dim", no_wrap=True, min_width=label_cells)
    grid.add_column(overflow="fold")  # a long value wraps onto the next line: never cut
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
        yield Label(GRAPHS[1].label, classes="spark-label", id="spark-tps-label")
        yield Sparkline([], id="spark-tps")
        yield Label(GRAPHS[2].label, classes="spark-label", id="spark-accepted-label")
        yield Sparkline([], id="spark-accepted")

    def on_mount(self) -> None:
        self.border_title = "metrics"
        self.show(None)
        self._render_setup()

    def show(self, f: Figures | None) -> None:
        ready = self._ready
        values = speed_values(f, ready)
        for widget_id, rows in (("#speed", SPEED), ("#timings", TIMINGS)):
            grid = _grid(12)
            for row in rows:
                if applies(row, ready) and row.label in values:
                    grid.add_row(row.label, values[row.label])
            self.query_one(widget_id, Static).update(grid)

        draft = has_draft(ready)
        counts = f.histogram if f and draft else ()
        histogram = self.query_one("#histogram", Static)
        histogram.display = sum(counts) > 0
        hist = Text(f"{GRAPHS[0].label}\n", style="dim")
        most = max(counts, default=0) or 1
        for accepted, count in enumerate(counts):
            hist.append(f"{accepted:>2} ", style="dim")
            hist.append(bar(count / most), style="green" if accepted == len(counts) - 1 else "cyan")
            hist.append(f" {count:>4}\n")
        hist.rstrip()
        histogram.update(hist)

        for name, data, shown in (("tps", f.spark_tps if f else (), True),
                                  ("accepted", f.spark_accepted if f else (), draft)):
            self.query_one(f"#spark-{name}", Sparkline).data = list(data)
            for widget in (self.query_one(f"#spark-{name}-label"), self.query_one(f"#spark-{name}")):
                widget.display = shown and bool(data)

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
            setup.add_row("draft", short_model(ready.draft) if has_draft(ready) else "none")
            k = f" · K={ready.k}" if has_draft(ready) else ""  # no K, no split where they mean nothing
            if ready.mode == "relay":
                setup.add_row("split", f"{ready.split}/{ready.n_layers} · {weights(ready)}{k}")
            else:
                setup.add_row("weights", weights(ready) + k)
            setup.add_row("device", f"{ready.device} ({ready.mode})")
        self.query_one("#setup", Static).update(setup)
