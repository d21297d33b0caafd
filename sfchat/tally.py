"""One reply's figures, folded from its rounds: the one tally the runtime and the metrics panel share.

Contract: ``Tally(k)`` takes every round of one reply (``add(stats, elapsed_s)``, with the
``RoundStats`` and the seconds since the reply was submitted) and answers the reply's figures:
``tps`` (committed tokens per second of the rounds after the first, whose time is the prompt's
prefill; of all rounds while there is only one), ``ttft_s``, ``prefill_s``, ``tokens_per_round``,
``histogram`` (rounds that accepted 0, 1, ... drafts), the mean of any ``RoundStats`` field
(``mean``), ``hit_rate`` (verdicts after the first whose frame went out while another was in
flight, and committed tokens) and ``figures()``: all of them as the fields of ``events.ReplyFinished``.
The head builds its ``ReplyFinished`` from a tally; the panel keeps one over the same events,
so both show the same numbers while the reply streams and after. Plain Python, torch-free.
"""

from __future__ import annotations

from sfchat.events import RoundStats


class Tally:
    def __init__(self, k: int = 0) -> None:
        self.k = k
        self.stats: list[RoundStats] = []
        self.tokens = 0
        self.histogram = [0] * (k + 1)
        self.ttft_s: float | None = None

    def add(self, stats: RoundStats, elapsed_s: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = elapsed_s
        self.stats.append(stats)
        self.tokens += stats.committed
        if stats.accepted >= len(self.histogram):  # a verdict deeper than the tally was made for (a tree's path): widen, never drop
            self.histogram.extend([0] * (stats.accepted + 1 - len(self.histogram)))
        self.histogram[stats.accepted] += 1

    @property
    def rounds(self) -> int:
        return len(self.stats)

    @property
    def tps(self) -> float | None:
        steady = self.stats[1:] or self.stats
        seconds = sum(r.round_ms for r in steady) / 1e3
        return sum(r.committed for r in steady) / seconds if seconds > 0 else None

    @property
    def prefill_s(self) -> float | None:
        return self.stats[0].round_ms / 1e3 if self.stats else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.tokens / len(self.stats) if self.stats else None

    @property
    def hit_rate(self) -> float | None:
        steady = self.stats[1:]
        return sum(r.speculated for r in steady) / len(steady) if steady else None

    def mean(self, field: str) -> float | None:
        return sum(getattr(r, field) for r in self.stats) / len(self.stats) if self.stats else None

    def figures(self) -> dict:
        """The figures of ``ReplyFinished`` (0 where nothing was measured)."""
        mean = {f: self.mean(f) or 0.0 for f in ("round_ms", "rtt_ms", "draft_ms", "head_ms", "tail_ms", "wait_ms",
                                                 "overlap_ms", "in_flight", "depth", "forward_bytes")}
        return dict(
            rounds=self.rounds, tokens_per_round=self.tokens_per_round or 0.0,
            accepted_histogram=tuple(self.histogram), tps=self.tps or 0.0, ttft_s=self.ttft_s or 0.0,
            prefill_s=self.prefill_s or 0.0, round_ms=mean["round_ms"], rtt_ms=mean["rtt_ms"],
            draft_ms=mean["draft_ms"], head_ms=mean["head_ms"], tail_ms=mean["tail_ms"], wait_ms=mean["wait_ms"],
            overlap_ms=mean["overlap_ms"], hit_rate=self.hit_rate or 0.0, in_flight_mean=mean["in_flight"],
            depth_mean=mean["depth"], forward_bytes=mean["forward_bytes"])
