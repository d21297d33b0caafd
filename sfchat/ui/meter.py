"""Figures of speculative decoding, computed from the runtime's round events.

Contract: ``Meter`` folds ``ReplyStarted`` / ``TokensCommitted`` / ``ReplyFinished`` into the
numbers the metrics panel shows and returns them as an immutable ``Figures``. It is plain
Python (no Textual), so the arithmetic is tested without a screen.

Scopes: tok/s, time to first token, tokens per round, the acceptance histogram and the
draft/head/tail times describe the current (or last) reply; the RTT percentiles and the
sparklines describe the most recent rounds across replies, since the link outlives a reply.
The reply's figures come from a ``tally.Tally`` of its rounds, the same one the head builds its
``ReplyFinished`` from, so the panel and the runtime agree while the reply streams and after;
``new_chat`` clears them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sfchat.events import ReplyFinished, ReplyStarted, RoundStats, TokensCommitted
from sfchat.tally import Tally

NOW_ROUNDS = 4  # "tok/s now" averages this many rounds: one round alone is too jumpy
SPARK_ROUNDS = 60
RTT_ROUNDS = 256


@dataclass(frozen=True)
class Figures:
    """What the panel shows; None where nothing has been measured yet."""

    k: int
    tokens: int
    rounds: int
    tps_now: float | None
    tps_mean: float | None
    ttft_s: float | None
    tokens_per_round: float | None
    accepted_mean: float | None
    histogram: tuple[int, ...]  # rounds that accepted 0..k drafts
    rtt_p50_ms: float | None
    rtt_p95_ms: float | None
    draft_ms: float | None
    head_ms: float | None
    tail_ms: float | None
    wait_ms: float | None  # blocked on the verdict
    overlap_ms: float | None  # rounds speculated while verdicts travelled
    hit_rate: float | None  # rounds after the first whose frame went out before the verdict it assumed
    in_flight: int | None  # frames in flight when the last verdict came
    tree_nodes: int  # nodes of the last round's token tree (0: chains)
    last_depth: int  # drafts of the last round's chain (or its tree's depth)
    depth_mean: float | None  # how deep the rounds' drafts reached
    forward_bytes: float | None  # mean size of a verify FORWARD
    spark_tps: tuple[float, ...]
    spark_accepted: tuple[float, ...]
    prompt_tokens: int | None
    reused_tokens: int | None
    finished: bool


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of unsorted values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil without float rounding surprises
    return ordered[int(rank) - 1]


class Meter:
    """Running figures of the current reply and of recent rounds."""

    def __init__(self, k: int = 0) -> None:
        self.k = k
        self._recent_tps: deque[float] = deque(maxlen=SPARK_ROUNDS)
        self._recent_accepted: deque[float] = deque(maxlen=SPARK_ROUNDS)
        self._recent_rtt: deque[float] = deque(maxlen=RTT_ROUNDS)
        self._reset_reply()

    def _reset_reply(self) -> None:
        self._tally = Tally(self.k)
        self._last: RoundStats | None = None
        self._started: ReplyStarted | None = None
        self._finished: ReplyFinished | None = None

    def set_k(self, k: int) -> None:
        self.k = k
        self._tally = Tally(k)

    def new_chat(self) -> None:
        """A new (or reopened) chat: no reply figures until its first reply; the link's recent
        rounds (RTT, sparklines) stay."""
        self._reset_reply()

    def reply_started(self, event: ReplyStarted) -> None:
        self._reset_reply()
        self._started = event

    def round(self, event: TokensCommitted) -> None:
        s = event.stats
        self._tally.add(s, event.elapsed_s)
        self._last = s
        self._recent_tps.append(_rate(s.committed, s.round_ms) or 0.0)
        self._recent_accepted.append(float(s.accepted))
        self._recent_rtt.append(s.rtt_ms)

    def reply_finished(self, event: ReplyFinished) -> None:
        self._finished = event

    def figures(self) -> Figures:
        tally, last = self._tally, self._last
        recent = tally.stats[-NOW_ROUNDS:]
        histogram = tuple(tally.histogram)
        counted = sum(histogram)
        rtts = list(self._recent_rtt)
        return Figures(
            k=self.k,
            tokens=tally.tokens,
            rounds=tally.rounds,
            tps_now=_rate(sum(r.committed for r in recent), sum(r.round_ms for r in recent)),
            tps_mean=tally.tps,
            ttft_s=tally.ttft_s,
            tokens_per_round=tally.tokens_per_round,
            accepted_mean=(sum(i * c for i, c in enumerate(histogram)) / counted) if counted else None,
            histogram=histogram,
            rtt_p50_ms=percentile(rtts, 50),
            rtt_p95_ms=percentile(rtts, 95),
            draft_ms=tally.mean("draft_ms"),
            head_ms=tally.mean("head_ms"),
            tail_ms=tally.mean("tail_ms"),
            wait_ms=tally.mean("wait_ms"),
            overlap_ms=tally.mean("overlap_ms"),
            hit_rate=tally.hit_rate,
            in_flight=last.in_flight if last else None,
            tree_nodes=last.tree_nodes if last else 0,
            last_depth=last.depth if last else 0,
            depth_mean=tally.mean("depth"),
            forward_bytes=tally.mean("forward_bytes"),
            spark_tps=tuple(self._recent_tps),
            spark_accepted=tuple(self._recent_accepted),
            prompt_tokens=self._started.prompt_tokens if self._started else None,
            reused_tokens=self._started.reused_tokens if self._started else None,
            finished=self._finished is not None,
        )


def _rate(tokens: int, ms: float) -> float | None:
    return tokens * 1000.0 / ms if ms > 0 else None
