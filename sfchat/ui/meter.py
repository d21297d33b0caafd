"""Figures of speculative decoding, computed from the runtime's round events.

Contract: ``Meter`` folds ``ReplyStarted`` / ``TokensCommitted`` / ``ReplyFinished`` into the
numbers the metrics panel shows and returns them as an immutable ``Figures``. It is plain
Python (no Textual), so the arithmetic is tested without a screen.

Scopes: tok/s, time to first token, tokens per round, the acceptance histogram and the
draft/head/tail times describe the current (or last) reply; the RTT percentiles and the
sparklines describe the most recent rounds across replies, since the link outlives a reply.
When a reply finishes, the runtime's own totals replace the running estimates; ``new_chat``
clears the reply's figures.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sfchat.events import ReplyFinished, ReplyStarted, TokensCommitted

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
        self._tokens = 0
        self._histogram = [0] * (self.k + 1)
        self._round_ms: list[float] = []
        self._committed: list[int] = []
        self._draft_ms = self._head_ms = self._tail_ms = self._wait_ms = self._overlap_ms = 0.0
        self._speculated = 0
        self._depth = self._forward_bytes = 0
        self._tree_nodes = self._last_depth = 0
        self._in_flight: int | None = None
        self._ttft_s: float | None = None
        self._started: ReplyStarted | None = None
        self._finished: ReplyFinished | None = None

    def set_k(self, k: int) -> None:
        self.k = k
        self._histogram = [0] * (k + 1)

    def new_chat(self) -> None:
        """A new (or reopened) chat: no reply figures until its first reply; the link's recent
        rounds (RTT, sparklines) stay."""
        self._reset_reply()

    def reply_started(self, event: ReplyStarted) -> None:
        self._reset_reply()
        self._started = event

    def round(self, event: TokensCommitted) -> None:
        s = event.stats
        if self._ttft_s is None:
            self._ttft_s = event.elapsed_s
        self._tokens += s.committed
        if s.accepted >= len(self._histogram):  # a runtime whose K grew: widen, never drop
            self._histogram.extend([0] * (s.accepted + 1 - len(self._histogram)))
        self._histogram[s.accepted] += 1
        self._round_ms.append(s.round_ms)
        self._committed.append(s.committed)
        self._draft_ms += s.draft_ms
        self._head_ms += s.head_ms
        self._tail_ms += s.tail_ms
        self._wait_ms += s.wait_ms
        self._overlap_ms += s.overlap_ms
        self._speculated += s.speculated
        self._depth += s.depth
        self._forward_bytes += s.forward_bytes
        self._tree_nodes, self._last_depth, self._in_flight = s.tree_nodes, s.depth, s.in_flight
        self._recent_tps.append(_rate(s.committed, s.round_ms) or 0.0)
        self._recent_accepted.append(float(s.accepted))
        self._recent_rtt.append(s.rtt_ms)

    def reply_finished(self, event: ReplyFinished) -> None:
        self._finished = event

    def figures(self) -> Figures:
        n = len(self._round_ms)
        fin = self._finished
        tps_now = _rate(sum(self._committed[-NOW_ROUNDS:]), sum(self._round_ms[-NOW_ROUNDS:]))
        tps_mean = _rate(self._tokens, sum(self._round_ms))
        ttft_s = self._ttft_s
        tokens_per_round = self._tokens / n if n else None
        draft_ms, head_ms, tail_ms = ((self._draft_ms / n, self._head_ms / n, self._tail_ms / n)
                                      if n else (None, None, None))
        wait_ms, overlap_ms = (self._wait_ms / n, self._overlap_ms / n) if n else (None, None)
        hit_rate = self._speculated / (n - 1) if n > 1 else None
        depth_mean, forward_bytes = (self._depth / n, self._forward_bytes / n) if n else (None, None)
        histogram = tuple(self._histogram)
        if fin is not None and fin.rounds:
            # The runtime measured the whole reply (prefill included); trust its totals.
            tps_mean, ttft_s, tokens_per_round = fin.tps, fin.ttft_s, fin.tokens_per_round
            draft_ms, head_ms, tail_ms = fin.draft_ms, fin.head_ms, fin.tail_ms
            wait_ms, overlap_ms, hit_rate = fin.wait_ms, fin.overlap_ms, fin.hit_rate
            depth_mean, forward_bytes = fin.depth_mean, fin.forward_bytes
            if fin.accepted_histogram:
                histogram = tuple(fin.accepted_histogram)
        counted = sum(histogram)
        accepted_mean = (sum(i * c for i, c in enumerate(histogram)) / counted) if counted else None
        rtts = list(self._recent_rtt)
        return Figures(
            k=self.k,
            tokens=self._tokens,
            rounds=n,
            tps_now=tps_now,
            tps_mean=tps_mean,
            ttft_s=ttft_s,
            tokens_per_round=tokens_per_round,
            accepted_mean=accepted_mean,
            histogram=histogram,
            rtt_p50_ms=percentile(rtts, 50),
            rtt_p95_ms=percentile(rtts, 95),
            draft_ms=draft_ms,
            head_ms=head_ms,
            tail_ms=tail_ms,
            wait_ms=wait_ms,
            overlap_ms=overlap_ms,
            hit_rate=hit_rate,
            in_flight=self._in_flight,
            tree_nodes=self._tree_nodes,
            last_depth=self._last_depth,
            depth_mean=depth_mean,
            forward_bytes=forward_bytes,
            spark_tps=tuple(self._recent_tps),
            spark_accepted=tuple(self._recent_accepted),
            prompt_tokens=self._started.prompt_tokens if self._started else None,
            reused_tokens=self._started.reused_tokens if self._started else None,
            finished=fin is not None,
        )


def _rate(tokens: int, ms: float) -> float | None:
    return tokens * 1000.0 / ms if ms > 0 else None
