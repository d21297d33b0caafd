"""How many frames in flight: chosen from measured frames. Torch-free.

Contract
--------
``PipelinePolicy(max_in_flight)`` learns from every verdict (``observe``) and answers
``choose() -> frames in flight``, all measured, none guessed (every frame has the one shape
of the frame layout):

* the link: a verdict's latency less the tail's compute, fitted as ``base + bytes x cost`` over
  the frames (frames of different byte counts, prefill ones among them, show its throughput);
* compute: the head's time to build a frame (draft and head slice, steady frames only: no
  prefill), the tail's, and the head's own overhead per verdict (taking it, the link);
* ``min_yield``: the bar the driver holds the tree's own estimate of a frame's yield to before it
  sends that frame while others are in flight (``MIN_YIELD``);
* ``step_gain()``: what a draft step must add to a frame's expected yield to be worth its time:
  the tokens the pipeline commits per ms (per verdict, over the time between verdicts) times the
  measured ms of a step; 0 (every step runs) until both were measured.

A frame spends ``T`` = build + overhead + base + bytes x cost + tail from being built to its
verdict. The head, the tail and the link each serve one frame at a time, so with ``m`` frames in
flight verdicts come every ``max(build + overhead, tail, link, T / m)``: the smallest ``m`` that
keeps that spacing at the slowest stage's is enough (more frames only wait in a queue); one
until a frame without prefill has been measured. Knows nothing about models or links.
"""

from __future__ import annotations

import math

WEIGHT = 0.2  # of the newest frame in every running estimate
MIN_YIELD = 0.25  # a frame sent while others are in flight must be expected to commit this many tokens


class PipelinePolicy:
    min_yield = MIN_YIELD  # tokens a frame sent while others are in flight must be expected to commit

    def __init__(self, max_in_flight: int = 1):
        self.max_in_flight = max(1, max_in_flight)
        self.build: float | None = None
        self.tail = self.bytes = 0.0
        self.tokens: float | None = None  # committed per verdict
        self.spacing: float | None = None  # ms between verdicts
        self.step_ms: float | None = None  # one draft expansion step
        self.overhead = 0.0
        self.verdicts = 0
        self._x = self._y = self._xx = self._xy = None  # link fit: bytes, latency ms
        self.base_ms, self.ms_per_byte = 0.0, 0.0

    # -- learning ------------------------------------------------------------------------------
    def observe(self, *, tokens: int, sent_bytes: int, rtt_ms: float, tail_ms: float,
                build_ms: float | None = None, overhead_ms: float | None = None, round_ms: float | None = None,
                step_ms: float | None = None) -> None:
        """One verdict of a frame that committed ``tokens``, sent ``sent_bytes``, came back ``rtt_ms``
        after sending (the tail's ``tail_ms`` excluded); ``build_ms`` of a steady frame; ``round_ms``
        since the verdict before; ``step_ms`` of the frame's draft steps, when it ran any."""
        first = self.verdicts == 0
        self.verdicts += 1
        self.tail = tail_ms if first else _ema(self.tail, tail_ms)
        self.bytes = float(sent_bytes) if first else _ema(self.bytes, float(sent_bytes))
        if build_ms is not None:
            self.build = _ema(self.build, build_ms)
        if overhead_ms is not None:
            self.overhead = _ema(self.overhead, max(0.0, overhead_ms))
        if round_ms is not None and round_ms > 0:
            self.tokens, self.spacing = _ema(self.tokens, float(tokens)), _ema(self.spacing, round_ms)
        if step_ms is not None:
            self.step_ms = _ema(self.step_ms, step_ms)
        self._fit(float(sent_bytes), max(0.0, rtt_ms))

    def _fit(self, x: float, y: float) -> None:
        self._x, self._y = _ema(self._x, x), _ema(self._y, y)
        self._xx, self._xy = _ema(self._xx, x * x), _ema(self._xy, x * y)
        var = self._xx - self._x ** 2
        if var > (0.05 * self._x) ** 2 + 1.0:  # frames that differ enough to tell bandwidth from latency
            self.ms_per_byte = max(0.0, (self._xy - self._x * self._y) / var)
        self.base_ms = max(0.0, self._y - self.ms_per_byte * self._x)

    # -- prediction ----------------------------------------------------------------------------
    def timing(self) -> tuple[float, float]:
        """(a frame's time from built to verdict, the spacing of its slowest stage) in ms."""
        build = (self.build or 0.0) + self.overhead
        link = self.bytes * self.ms_per_byte
        return build + self.base_ms + link + self.tail, max(build, self.tail, link, 1e-3)

    def in_flight(self) -> int:
        """Frames enough to keep the slowest stage busy over one frame's round trip."""
        total, stage = self.timing()
        return max(1, min(self.max_in_flight, math.ceil(total / stage - 1e-9)))

    def step_gain(self) -> float:
        """Tokens a draft step must add to a frame's expected yield to pay for its time."""
        if not self.spacing or self.step_ms is None or self.tokens is None:
            return 0.0
        return self.step_ms * self.tokens / self.spacing

    # -- the choice ----------------------------------------------------------------------------
    def choose(self) -> int:
        """Frames to keep in flight: one until a steady frame was measured."""
        return 1 if self.build is None else self.in_flight()


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
