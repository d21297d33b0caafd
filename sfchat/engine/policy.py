"""How large a frame, how many in flight: chosen from measured frames. Torch-free.

Contract
--------
``PipelinePolicy(sizes, max_in_flight)`` learns from every verdict (``observe``) and answers
``choose() -> (frame size, frames in flight)``, all measured, none guessed:

* the link: a verdict's latency less the tail's compute, fitted as ``base + bytes x cost`` over
  the frames (frames of different sizes show what the link's throughput is);
* compute: the head's time to build a frame of each size (draft and head slice, steady frames
  only: no prefill), the tail's, and the head's own overhead per verdict (taking it, the link);
* yield: the tokens a verdict of each size committed (the tree's own estimate of a frame's
  yield decides whether a frame goes out while others are in flight at all: ``MIN_YIELD``).

A frame spends ``T`` = build + overhead + base + bytes x cost + tail from being built to its
verdict. The head, the tail and the link each serve one frame at a time, so with ``m`` frames in
flight verdicts come every ``max(build + overhead, tail, link, T / m)``: the smallest ``m`` that
keeps that spacing at the slowest stage's is enough (more frames only wait in a queue), and the
size whose yield per spacing is highest wins. Sizes never measured are tried first, and every
``EXPLORE_EVERY`` verdicts the least recently used size runs once, so that estimates of sizes not
chosen stay current. Knows nothing about models or links.
"""

from __future__ import annotations

import math

WEIGHT = 0.2  # of the newest frame in every running estimate
EXPLORE_EVERY = 24  # verdicts between two runs of the least recently used size
MIN_YIELD = 0.25  # a frame sent while others are in flight must be expected to commit this many tokens


class PipelinePolicy:
    min_yield = MIN_YIELD  # tokens a frame sent while others are in flight must be expected to commit

    def __init__(self, sizes: list[int], max_in_flight: int = 1):
        self.sizes = sorted(sizes, reverse=True)
        self.max_in_flight = max(1, max_in_flight)
        self.build: dict[int, float] = {}
        self.tail: dict[int, float] = {}
        self.bytes: dict[int, float] = {}
        self.tokens: dict[int, float] = {}
        self.last_used: dict[int, int] = {}
        self.overhead = 0.0
        self.verdicts = 0
        self._x = self._y = self._xx = self._xy = None  # link fit: bytes, latency ms
        self.base_ms, self.ms_per_byte = 0.0, 0.0

    # -- learning ------------------------------------------------------------------------------
    def observe(self, size: int, *, tokens: int, sent_bytes: int, rtt_ms: float, tail_ms: float,
                build_ms: float | None = None, overhead_ms: float | None = None) -> None:
        """One verdict of a frame of ``size`` that committed ``tokens``, sent ``sent_bytes``, came back
        ``rtt_ms`` after sending (the tail's ``tail_ms`` excluded); ``build_ms`` of a steady frame."""
        self.verdicts += 1
        self.last_used[size] = self.verdicts
        self.tail[size] = _ema(self.tail.get(size), tail_ms)
        self.bytes[size] = _ema(self.bytes.get(size), float(sent_bytes))
        self.tokens[size] = _ema(self.tokens.get(size), float(tokens))
        if build_ms is not None:
            self.build[size] = _ema(self.build.get(size), build_ms)
        if overhead_ms is not None:
            self.overhead = _ema(self.overhead, max(0.0, overhead_ms))
        self._fit(float(sent_bytes), max(0.0, rtt_ms))

    def _fit(self, x: float, y: float) -> None:
        self._x, self._y = _ema(self._x, x), _ema(self._y, y)
        self._xx, self._xy = _ema(self._xx, x * x), _ema(self._xy, x * y)
        var = self._xx - self._x ** 2
        if var > (0.05 * self._x) ** 2 + 1.0:  # sizes that differ enough to tell bandwidth from latency
            self.ms_per_byte = max(0.0, (self._xy - self._x * self._y) / var)
        self.base_ms = max(0.0, self._y - self.ms_per_byte * self._x)

    # -- prediction ----------------------------------------------------------------------------
    def timing(self, size: int) -> tuple[float, float]:
        """(the frame's time from built to verdict, the spacing of its slowest stage) in ms."""
        build = self.build.get(size, 0.0) + self.overhead
        link = self.bytes.get(size, 0.0) * self.ms_per_byte
        tail = self.tail.get(size, 0.0)
        return build + self.base_ms + link + tail, max(build, tail, link, 1e-3)

    def in_flight(self, size: int) -> int:
        """Frames enough to keep the slowest stage busy over one frame's round trip."""
        total, stage = self.timing(size)
        return max(1, min(self.max_in_flight, math.ceil(total / stage - 1e-9)))

    def rate(self, size: int) -> float:
        """Expected tokens per ms with ``in_flight(size)`` frames."""
        total, stage = self.timing(size)
        return self.tokens.get(size, 0.0) / max(stage, total / self.in_flight(size))

    # -- the choice ----------------------------------------------------------------------------
    def choose(self) -> tuple[int, int]:
        untried = [s for s in self.sizes if s not in self.build]
        if untried:
            return untried[0], 1
        if len(self.sizes) > 1 and self.verdicts % EXPLORE_EVERY == 0:
            size = min(self.sizes, key=lambda s: self.last_used.get(s, 0))
            return size, self.in_flight(size)
        best = max(self.sizes, key=self.rate)
        return best, self.in_flight(best)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
