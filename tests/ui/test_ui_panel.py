"""Pilot tests of the metrics panel: rows that do not apply are hidden (no draft, local mode), every
row fits whole at 80x24, and the help screen explains every row the panel shows."""

from __future__ import annotations

import threading
from dataclasses import replace

from sfchat.events import LinkState, ReplyFinished, ReplyStarted, RoundStats, TokensCommitted
from sfchat.tally import Tally

from pilots import READY, FakeRuntime, chat_app, db, pilot_test, send, static_text, wait_for  # noqa: F401

K = 4
LOCAL = replace(READY, draft="none", k=0, mode="local", model="HuggingFaceTB/SmolLM2-135M-Instruct")
# a relay pair at its widest: a tail computing in another dtype, 4-bit weights, trees, slow rounds
WIDE = replace(READY, k=8, tail_dtype="float16", quant="nf4", tree_budget=64,
               shapes=("chain 0", "chain 2", "chain 4", "chain 8", "tree 64, depth 8"), max_in_flight=4)
SLOW = RoundStats(accepted=5, committed=6, draft_ms=5564.0, head_ms=2036.0, tail_ms=452.0, rtt_ms=12345.0,
                  round_ms=20500.0, wait_ms=10234.0, overlap_ms=1234.0, speculated=True,
                  forward_bytes=455 * 1024, tree_nodes=65, depth=8, in_flight=4)
LOCAL_ROUND = RoundStats(accepted=0, committed=1, draft_ms=0.0, head_ms=3.0, tail_ms=3.0, rtt_ms=0.4,
                         round_ms=7.0, forward_bytes=2048, depth=0)


class RoundsRuntime(FakeRuntime):
    """Ready as ``ready`` says (after LinkState ``link``); a reply is ``rounds`` of ``stats``."""

    def __init__(self, ready, stats: RoundStats, rounds: int = 6, link: str = "connected",
                 prompt: tuple[int, int] = (40, 10)) -> None:
        super().__init__()
        self.ready_event, self.stats, self.rounds, self.link, self.prompt = ready, stats, rounds, link, prompt

    def _load(self) -> None:
        self._listener(LinkState(self.link, "" if self.link == "local" else "ws://203.0.113.7:8765"))
        self._listener(self.ready_event)

    def submit(self, messages, params) -> None:
        threading.Thread(target=self._reply, daemon=True).start()

    def _reply(self) -> None:
        emit, tally = self._listener, Tally(self.ready_event.k)
        emit(ReplyStarted(prompt_tokens=self.prompt[0], reused_tokens=self.prompt[1],
                          prefill_tokens=self.prompt[0] - self.prompt[1]))
        for i in range(self.rounds):
            ids = tuple(range(self.stats.committed))
            emit(TokensCommitted(f"w{i} ", ids, self.stats, 0.5 + i))
            tally.add(self.stats, 0.5 + i)
        text = "".join(f"w{i} " for i in range(self.rounds))
        emit(ReplyFinished("eos", text, tuple(range(tally.tokens)), self.prompt[0], **tally.figures()))


GRIDS = ("#speed", "#timings", "#setup")


def panel_parts(app) -> dict[str, list[str]]:
    """The lines of each shown part of the panel, the parts scrolled out of view included."""
    parts = {}
    for part in (*GRIDS, "#histogram", ".spark-label"):
        for i, widget in enumerate(app.query(f"#metrics {part}")):
            if widget.display:
                parts[part if part in GRIDS else f"{part} {i}"] = [
                    line for line in static_text(widget).splitlines() if line.strip()]
    return parts


def panel_lines(app) -> list[str]:
    return [line for lines in panel_parts(app).values() for line in lines]


def row_labels(app) -> list[str]:
    """The label of every row shown: a grid's first column (its values all start at one column;
    a value's continuation lines start blank), the histogram's title, the sparklines' labels."""
    labels = []
    for part, lines in panel_parts(app).items():
        if part not in GRIDS:
            labels.append(lines[0].strip())
            continue
        rows = [line for line in lines if not line.startswith(" ")]
        column = min(c for c in range(1, max(map(len, rows)))
                     if all(len(r) > c and r[c - 1] == " " and r[c] != " " for r in rows))
        labels += [r[:column].strip() for r in rows]
    return labels


async def reply_shown(pilot, app) -> None:
    await wait_for(pilot, lambda: app.ready is not None)
    await send(pilot, "hello there")
    await wait_for(pilot, lambda: not app.session.replying and app.session.turns)
    await pilot.pause(0.2)


@pilot_test
async def test_local_mode_without_a_draft_shows_no_network_or_draft_rows(db):
    runtime = RoundsRuntime(LOCAL, LOCAL_ROUND, link="local")
    async with chat_app(runtime, db, size=(120, 40), ready=False) as (app, pilot):
        await reply_shown(pilot, app)
        shown = "\n".join(panel_lines(app))
        for noise in ("RTT", "sent/round", "frame", "in flight", "wait/overlap", "accepted", "drafts",
                      "tokens/round", "draft model", "draft/head/tail"):
            assert noise not in shown, (noise, shown)
        for row in ("tok/s now", "tok/s mean", "first token", "head/tail", "prompt", "tok/s per round"):
            assert row in shown, (row, shown)
        assert "draft  SmolLM2" not in shown and "none" in shown  # the setup says there is no draft
        assert app.query_one("#metrics").border_title == "metrics"  # not "speculation"
        status = static_text(app.query_one("#status"))
        assert "tok/s" in status and "RTT" not in status and "tok/round" not in status, status


@pilot_test
async def test_at_80x24_every_panel_row_fits_whole(db):
    runtime = RoundsRuntime(WIDE, SLOW, prompt=(32768, 32000))
    async with chat_app(runtime, db, size=(80, 24), ready=False) as (app, pilot):
        await reply_shown(pilot, app)
        await pilot.press("f3")
        await pilot.pause(0.2)
        panel = app.query_one("#metrics")
        lines = panel_lines(app)
        assert not [line for line in lines if "…" in line], lines
        text = " ".join(" ".join(lines).split())
        for row in ("RTT p50/p95 12345 / 12345 ms", "draft model 5564 ms", "head/tail 2036 / 452 ms",
                    "wait/overlap 10234 / 1234 ms", "in flight 4 · 100% held", "drafts tree 64, depth 8.0",
                    "sent/round 455 KiB", "prompt 32768 (32000 cached)", "accepted 5.00 of 8",
                    "split 14/28 · bf16/float16+nf4 · K=8", "link ● connected (ws://203.0.113.7:8765)"):
            assert row in text, (row, lines)
        for part in ("#speed", "#timings", "#setup"):
            region = app.query_one(part).region
            assert panel.content_region.x <= region.x and region.right <= panel.content_region.right, part
        assert panel.region.right <= 80


@pilot_test
async def test_the_help_explains_every_row_the_panel_shows(db):
    async with chat_app(RoundsRuntime(WIDE, SLOW), db, size=(120, 40), ready=False) as (app, pilot):
        await reply_shown(pilot, app)
        labels = row_labels(app)
        assert "RTT p50/p95" in labels and "tok/s per round" in labels and "link" in labels, labels
        footer = [s.text for s in app.screen._compositor.render_strips()][-1]
        assert "f1 Help" in footer, footer
        main = app.screen
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen is not main)
        helped = [line.strip() for w in app.screen.query("Static") for line in static_text(w).splitlines()]
        for label in labels:
            explained = [line for line in helped if line.startswith(label + "  ")]
            assert explained and len(explained[0].split()) >= len(label.split()) + 5, (label, helped)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is main)
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        commands["Metrics explained"].callback()
        await wait_for(pilot, lambda: app.screen is not main)

        def at_the_figures() -> bool:  # once the screen has laid itself out (later on a loaded machine)
            heading, box = app.screen.query("#help-figures"), app.screen.query("#help-box")
            return bool(heading and box) and box.first().scroll_y > 0 and \
                heading.first().region.y <= box.first().content_region.y + 1

        await wait_for(pilot, at_the_figures)  # opened at the figures
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is main)


def test_the_dtype_label_names_a_tail_that_computes_in_another_dtype():
    from sfchat.ui.metrics import weights

    assert weights(READY) == "bf16"
    assert weights(replace(READY, dtype="bfloat16", tail_dtype="float16")) == "bfloat16/float16"
    assert weights(replace(READY, tail_dtype="float16", quant="nf4")) == "bf16/float16+nf4"


def test_the_panel_names_the_round_shape_its_depth_frames_in_flight_and_hits():
    from sfchat.ui.meter import Meter
    from sfchat.ui.metrics import drafts_text, flight_text

    meter = Meter(K)
    # as the driver reports them: a frame's nodes are its drafts and the committed context's next node
    rounds = ((5, 65, 455 * 1024, 1, False), (6, 65, 455 * 1024, 3, True), (4, 4, 63 * 1024, 4, True))
    for depth, nodes, size, flight, speculated in rounds:
        stats = RoundStats(accepted=3, committed=4, draft_ms=1, head_ms=1, tail_ms=1, rtt_ms=80, round_ms=90,
                           forward_bytes=size, tree_nodes=nodes, depth=depth, in_flight=flight,
                           speculated=speculated)
        meter.round(TokensCommitted("ab", (1, 2, 3, 4), stats, 0.1))
        if nodes > depth:
            assert drafts_text(meter.figures(), READY).startswith("tree 64, depth ")
    f = meter.figures()
    assert f.depth_mean == 5.0 and f.tree_nodes == 4 and f.in_flight == 4
    assert drafts_text(f, READY) == "chain 3"  # before: "tree 4, depth 5.0" for a chain of 3 drafts
    assert flight_text(f) == "4 · 100% held"
    shapes = ("chain 0", "chain 2", "chain 4", "chain 8", "tree 64, depth 8")
    assert drafts_text(None, replace(READY, shapes=shapes)) == "auto: " + " / ".join(shapes)
    assert drafts_text(None, replace(READY, shapes=("chain 8",))) == "chain 8"
    assert drafts_text(None, None) == "–" and flight_text(None) == "–"
