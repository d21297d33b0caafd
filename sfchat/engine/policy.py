"""How the head schedules its frames: chosen from measured verdicts. Torch-free.

Contract
--------
``PipelinePolicy(max_in_flight, schedules)`` learns from every verdict (``observe``) and answers,
for the next frame, which ``Schedule`` the head follows, chosen on measured rates (a forecast only
rules out a trial that cannot pay; every frame has the one shape of the frame layout):

* a **schedule** is a way to spend the head's time: ``ROUND`` builds one frame per round trip
  with all of its ``--k`` draft steps (its own steps stop once one adds less than ``step_gain()``)
  and waits for its verdict; ``STREAM`` builds frames of at most ``STREAM_STEPS`` draft steps of
  their own and keeps as many in flight as the timing below asks for, each taking the best unsent
  nodes of the live tree (a stream of shallow frames whose nodes hang below those in flight).
  Which pays depends on the round trip against a draft step (a frame built under frames in flight
  bets on their outcomes): so the policy measures each schedule's committed tokens per ms on
  a trial (``TRIAL_VERDICTS`` and ``trial_ms()`` at least: ``TRIAL_TRIPS`` of a frame's time from
  built to verdict, within ``TRIAL_MIN_MS`` and ``TRIAL_MS``; or ``EARLY_VERDICTS`` once every
  schedule was measured and the best leads by ``EARLY_CONFIDENCE`` standard errors: a verdict per
  round trip is slow to come by; ``SCHEDULES``' order, stream first: where the round trip is long
  its verdicts come often and it is the likelier winner, where it is short its trial is over soon),
  with the rate's standard error from the spread between batches of verdicts (a verdict each
  under one frame at a time, a frame's trip of them under frames in flight). It follows the best
  once its lead is ``CONFIDENCE`` standard errors of the difference (sure); short of that, the
  better mean for ``unsure_ms()`` (``UNSURE_MS``, or long enough that trying the other again takes
  at most ``RETRIAL_SHARE`` of the time) and then the other again, each schedule's verdicts adding
  up over the comparison, until one leads so or ``MAX_TRIALS`` trials were run (then the better
  mean: schedules that close cost little either way). A trial of a one-frame schedule is skipped
  (``Decision.skipped``) while the best measured beats its forecast (``forecast_rate``: the tree's
  expected yield of a frame from the committed root over a frame's whole trip)
  ``FORECAST_MARGIN`` times over: the best is followed, sure. After ``REVISIT_MS`` under a sure choice it
  compares anew (the link may change): the best's rate over the time it was followed against
  fresh trials of the others. Only verdicts of steady frames (no prefill) built under the schedule
  count, and none of the first after a switch (one frame at a time: the first; frames in flight:
  their fill and ``SETTLE`` more). ``schedule()`` is the schedule now (its
  ``steps``: the cap on a frame's own draft steps, None: the frame's ``--k``), ``choose()`` its
  frames in flight, ``counts`` the verdicts taken under each schedule, ``decisions`` the latest
  ``DECISIONS`` choices (``Decision``: after which verdict, each schedule's rate and the verdicts
  it is over, the one chosen, a trial or not, sure or not) for a report;
* the link: a verdict's latency less the tail's compute, fitted as ``base + bytes x cost`` over
  the frames (frames of different byte counts, prefill ones among them, show its throughput);
* compute: the head's time to build a frame (draft and head slice, steady frames only, per
  schedule), the tail's, and the head's own overhead per verdict (taking it, the link);
* ``min_yield``: the bar the driver holds the tree's own estimate of a frame's yield to before it
  sends that frame while others are in flight (``MIN_YIELD``);
* ``step_gain()``: what a draft step must add to a frame's expected yield to be worth its time:
  the tokens the pipeline commits per ms (per verdict, over the time between verdicts) times the
  measured ms of a step; 0 (every step runs) until both were measured.

A frame spends ``T`` = build + overhead + base + bytes x cost + tail from being built to its
verdict. The head, the tail and the link each serve one frame at a time, so with ``m`` frames in
flight verdicts come every ``max(build + overhead, tail, link, T / m)``: under ``STREAM`` the
smallest ``m`` that keeps that spacing at the slowest stage's is enough (more frames only wait in
a queue); one until a frame of the schedule without prefill has been measured. With
``max_in_flight`` 1 (local mode, or ``--max-in-flight 1``) the only schedule is ``ROUND``.
Knows nothing about models or links.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

WEIGHT = 0.2  # of the newest frame in every running estimate
MIN_YIELD = 0.25  # a frame sent while others are in flight must be expected to commit this many tokens
STREAM_STEPS = 2  # a streamed frame's own draft steps at most (bench/pipeline_sim.py: 2 was best or near it at 30-175 ms)
TRIAL_MS, TRIAL_VERDICTS = 1000.0, 12  # a schedule's trial: this many verdicts, and this long at most (below)
TRIAL_TRIPS, TRIAL_MIN_MS = 10, 300.0  # ...and at least this many of a frame's trips from built to verdict, or this
EARLY_VERDICTS, EARLY_CONFIDENCE = 5, 3.0  # a trial over TRIAL_MS may end at this many verdicts: a lead of this many SEs
CONFIDENCE = 2.0  # the best must lead by this many standard errors of the difference to be followed at once
MAX_TRIALS = 6  # trials in one comparison at most; then the best by its mean, whatever the spread
UNSURE_MS = 4000.0  # time under the better mean, short of a sure lead, before the other's next trial, at least:
RETRIAL_SHARE = 0.1  # ...and long enough that the other's next trial (as long as its last) takes at most this share
SETTLE = 2  # verdicts after a switch to frames in flight that do not count, beyond them (the pipeline fills)
REVISIT_MS = 60_000.0  # time under the best schedule before the others are measured again
DECISIONS = 64  # choices kept for a report
MIN_BATCHES = 3  # batches (a verdict each, or a trip's worth in flight) for a rate's error over them
FORECAST_MARGIN = 1.5  # a one-frame schedule is not tried while the best measured beats its forecast this many times over


@dataclass(frozen=True)
class Schedule:
    name: str
    steps: int | None  # a frame's own draft steps at most (None: its --k)
    frames: int | None  # frames in flight (None: as many as the timing asks for)


@dataclass(frozen=True)
class Decision:
    verdict: int  # the verdicts observed when it was made
    rates: dict[str, tuple[float, int, float]]  # per schedule: committed tokens per ms, the verdicts it is over, its SE
    chosen: str
    trial: bool  # measuring the chosen one (else following the best)
    sure: bool = False  # following one that leads by CONFIDENCE (or after MAX_TRIALS), for REVISIT_MS
    forecasts: dict[str, float] = field(default_factory=dict)  # one-frame schedules' forecast tokens per ms
    skipped: str | None = None  # the schedule whose trial its forecast ruled out


ROUND = Schedule("round", None, 1)
STREAM = Schedule("stream", STREAM_STEPS, None)
SCHEDULES = (STREAM, ROUND)  # compared, in this order, where frames may be in flight


class _Measured:
    """One schedule's figures: committed tokens per ms over the verdicts counted since its figures
    were last restarted (one comparison's trials together, or the time it was followed), with the
    standard error of that rate; a steady frame's build.

    The error comes from the spread between batches of consecutive verdicts, each at least the
    ``span`` given with a verdict (frames in flight: a frame's trip; one frame: 0, every verdict a
    batch): verdicts of frames in flight come in a cycle of the trip (on the simulator seven 16 ms
    apart, then one after 109 ms), whose spread verdict by verdict put a steady rate's error at 18
    % where batches of a trip varied by 0.1 % (RESULTS, twelfth session)."""

    def __init__(self) -> None:
        self.build: float | None = None
        self.counted = 0  # verdicts counted, ever
        self.restart()

    def restart(self) -> None:
        self.n = 0
        self.tokens = self.ms = self.open_tokens = self.open_ms = 0.0
        self.verdicts = _Sums()  # every verdict
        self.closed = _Sums()  # the closed batches

    def add(self, tokens: float, ms: float, span: float = 0.0) -> None:
        self.n += 1
        self.counted += 1
        self.tokens += tokens
        self.ms += ms
        self.verdicts.add(tokens, ms)
        self.open_tokens += tokens
        self.open_ms += ms
        if self.open_ms >= span:
            self.closed.add(self.open_tokens, self.open_ms)
            self.open_tokens = self.open_ms = 0.0

    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0

    def error(self) -> float:
        """The rate's standard error over the closed batches once there are ``MIN_BATCHES``, else
        over the verdicts one by one (an overstatement where they come in a cycle, never an
        understatement), inf below 2 verdicts."""
        return (self.closed if self.closed.n >= MIN_BATCHES else self.verdicts).error()


class _Sums:
    """Samples of (tokens, ms): the ratio of their sums and its standard error (first order)."""

    def __init__(self) -> None:
        self.n = 0
        self.t = self.m = self.tt = self.mm = self.tm = 0.0

    def add(self, t: float, m: float) -> None:
        self.n += 1
        self.t += t
        self.m += m
        self.tt += t * t
        self.mm += m * m
        self.tm += t * m

    def error(self) -> float:
        if self.n < 2 or self.m <= 0:
            return math.inf
        r = self.t / self.m
        spread = max(0.0, self.tt - 2 * r * self.tm + r * r * self.mm) / (self.n - 1)  # of tokens - r x ms
        return math.sqrt(spread / self.n) / (self.m / self.n)


class PipelinePolicy:
    min_yield = MIN_YIELD  # tokens a frame sent while others are in flight must be expected to commit

    def __init__(self, max_in_flight: int = 1, schedules: tuple[Schedule, ...] = SCHEDULES):
        self.max_in_flight = max(1, max_in_flight)
        self.schedules = schedules if self.max_in_flight > 1 else (ROUND,)
        self.measured = {sc.name: _Measured() for sc in self.schedules}
        self.counts = {sc.name: 0 for sc in self.schedules}
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS)
        self.current = self.schedules[0]
        self._since_switch = 0  # steady verdicts under the current schedule since it was chosen
        self._settle = SETTLE  # of them, those that do not count
        self._ran_ms, self._left_n = 0.0, TRIAL_VERDICTS  # counted time in this phase; verdicts before the next choice
        self._follow_ms = 0.0  # how long the best is followed (when not on a trial)
        self._trial = True  # measuring the current schedule (else following the best)
        self._trials = 1  # trials run in the comparison under way
        self._sure = False  # the schedule followed leads by CONFIDENCE (else only by its mean)
        self._trial_ran: dict[str, float] = {}  # per schedule: the counted ms of its last trial
        self.build: float | None = None  # the current schedule's steady frame build
        self.tail = self.bytes = 0.0
        self.tokens: float | None = None  # committed per verdict
        self.spacing: float | None = None  # ms between verdicts
        self.step_ms: float | None = None  # one draft expansion step
        self.forecast: float | None = None  # a frame from the committed root: its expected yield
        self.overhead = 0.0
        self.verdicts = 0
        self._x = self._y = self._xx = self._xy = None  # link fit: bytes, latency ms
        self.base_ms, self.ms_per_byte = 0.0, 0.0

    # -- learning ------------------------------------------------------------------------------
    def observe(self, *, tokens: int, sent_bytes: int, rtt_ms: float, tail_ms: float,
                build_ms: float | None = None, overhead_ms: float | None = None, round_ms: float | None = None,
                step_ms: float | None = None, schedule: str | None = None, forecast: float | None = None) -> None:
        """One verdict of a frame that committed ``tokens``, sent ``sent_bytes``, came back ``rtt_ms``
        after sending (the tail's ``tail_ms`` excluded); ``build_ms`` of a steady frame; ``round_ms``
        since the verdict before; ``step_ms`` of the frame's draft steps, when it ran any;
        ``schedule``: the name of the one the frame was built under; ``forecast``: the tokens one
        frame from the committed root would be expected to commit (the tree's values; the yield
        of a one-frame schedule, ``forecast_rate``), None where the tree cannot tell (then no
        trial is skipped until one comes). A schedule's rate counts the
        tokens committed, never the tree's estimate of a frame's yield: that one is steadier but
        biased, most where it matters (a young calibration, frames hung below frames in flight
        whose every unverified ancestor multiplies the error in)."""
        first = self.verdicts == 0
        self.verdicts += 1
        self.tail = tail_ms if first else _ema(self.tail, tail_ms)
        self.bytes = float(sent_bytes) if first else _ema(self.bytes, float(sent_bytes))
        if overhead_ms is not None:
            self.overhead = _ema(self.overhead, max(0.0, overhead_ms))
        if round_ms is not None and round_ms > 0:
            self.tokens, self.spacing = _ema(self.tokens, float(tokens)), _ema(self.spacing, round_ms)
        if step_ms is not None:
            self.step_ms = _ema(self.step_ms, step_ms)
        if self.current.frames != 1:  # after one frame's verdict its tree is thin: keep the forecast
            self.forecast = None if forecast is None else _ema(self.forecast, forecast)
        self._fit(float(sent_bytes), max(0.0, rtt_ms))
        name = schedule or self.current.name
        m = self.measured.get(name)
        if m is None:
            return
        self.counts[name] += 1
        if build_ms is not None:
            m.build = _ema(m.build, build_ms)
        self.build = self.measured[self.current.name].build
        if build_ms is None or name != self.current.name or not round_ms:
            return  # a prefill, a frame of the schedule before, or no time measured: not this schedule's rate
        self._since_switch += 1
        if self._since_switch <= self._settle:
            return
        m.add(float(tokens), round_ms, 0.0 if self.current.frames == 1 else self.timing()[0])
        self._ran_ms += round_ms
        self._left_n -= 1
        if self._ran_ms >= (self.trial_ms() if self._trial else self._follow_ms) and (
                self._left_n <= 0 or self._decided()):
            self._next()

    def _decided(self) -> bool:
        """Whether the trial under way may end before its ``TRIAL_VERDICTS``: it has run
        ``EARLY_VERDICTS``, every schedule was measured, and the best leads every other by
        ``EARLY_CONFIDENCE`` standard errors of the difference (a schedule whose verdicts take a
        round trip each, far slower than the other, need not spend a dozen round trips to show it)."""
        if not self._trial or self.measured[self.current.name].n < EARLY_VERDICTS:
            return False
        if any(self.measured[sc.name].n == 0 for sc in self.schedules):
            return False
        best = max(self.schedules, key=lambda sc: self.measured[sc.name].rate())
        return self._leads(best, [sc for sc in self.schedules if sc is not best], EARLY_CONFIDENCE)

    def _next(self) -> None:
        """Done measuring or following the current schedule. After a trial: the next one not
        measured yet; else the best, followed for ``REVISIT_MS`` when it leads the others by
        ``CONFIDENCE`` standard errors of the difference or ``MAX_TRIALS`` trials were run, else
        for ``unsure_ms()``, its verdicts adding to its figures, and then another trial of the
        one measured least, adding to its. After ``REVISIT_MS`` under the best: a new comparison,
        the others' figures afresh (their trials count from 1, the best's time followed stands
        for its own). With one schedule: that one, throughout."""
        unmeasured = [sc for sc in self.schedules if self.measured[sc.name].n == 0]
        best = max(self.schedules, key=lambda sc: self.measured[sc.name].rate())
        others = [sc for sc in self.schedules if sc is not best]
        least = min((sc for sc in self.schedules if sc is not self.current),
                    key=lambda sc: self.measured[sc.name].n, default=self.current)
        fresh = False  # the next schedule's figures start anew
        if self._trial:
            self._trial_ran[self.current.name] = self._ran_ms
        if len(self.schedules) == 1:  # nothing to compare: follow it
            nxt, self._trial, self._sure = self.current, False, True
        elif not self._trial and self._sure:  # followed for REVISIT_MS: compare anew, the others afresh
            for sc in self.schedules:
                if sc is not self.current:
                    self.measured[sc.name].restart()
            nxt, self._trial, self._trials = least, True, 1
        elif not self._trial:  # followed the better mean while unsure: try the other again
            nxt, self._trial, self._trials = least, True, self._trials + 1
        elif unmeasured:
            nxt, self._trials = unmeasured[0], self._trials + 1
        else:
            self._sure = not others or self._trials >= MAX_TRIALS or self._leads(best, others)
            nxt, self._trial, fresh = best, False, self._sure  # sure: its rate from here is the time it is followed
        skipped = nxt.name if self._trial and self._out_of_reach(nxt) else None
        if skipped:  # its forecast is far behind the best measured: follow that one, sure, for REVISIT_MS
            nxt = max((sc for sc in self.schedules if sc is not nxt), key=lambda sc: self.measured[sc.name].rate())
            self._trial, self._sure, fresh = False, True, True
        self._ran_ms, self._left_n = 0.0, TRIAL_VERDICTS if self._trial else 0
        self._follow_ms = REVISIT_MS if self._sure else self.unsure_ms(others)
        forecasts = {sc.name: self.forecast_rate(sc) for sc in self.schedules if sc.frames == 1}
        self.decisions.append(Decision(self.verdicts, {k: (m.rate(), m.n, m.error()) for k, m in self.measured.items()},
                                       nxt.name, self._trial, not self._trial and self._sure,
                                       {k: v for k, v in forecasts.items() if v is not None}, skipped))
        if fresh:
            self.measured[nxt.name].restart()
        if nxt is not self.current:
            self.current, self._since_switch = nxt, 0
            self.build = self.measured[nxt.name].build
            # what does not count: one frame at a time, its first verdict (those of the frames left in
            # flight by the schedule before are not its own, so never count); frames in flight, their
            # fill and SETTLE more
            self._settle = 1 if nxt.frames == 1 else SETTLE + self.choose()

    def forecast_rate(self, sc: Schedule) -> float | None:
        """A one-frame schedule's committed tokens per ms as the tree forecasts them: a frame from
        the committed root (``forecast``) every frame's time from built to verdict (its own build
        when it was measured, else the current schedule's: a round frame runs more steps, so the
        forecast errs towards it). None while there is no forecast or the schedule keeps more frames."""
        if sc.frames != 1 or self.forecast is None:
            return None
        build = self.measured[sc.name].build
        total = self.timing(build if build is not None else self.build)[0]
        return self.forecast / total if total > 0 else None

    def _out_of_reach(self, sc: Schedule) -> bool:
        """Whether a trial of ``sc`` cannot pay: another schedule measured (two verdicts or more),
        less a standard error of its rate, beats ``FORECAST_MARGIN`` times ``sc``'s forecast rate
        (one frame per round trip at 200 ms commits a third of a stream's tokens: its trial cost a
        short reply 7-9 %). The forecast came within -6 to +25 % of round's trials on the simulator,
        a third low on a young calibration (RESULTS, twelfth session): a wrong skip passes over a
        schedule a few percent ahead at most, until the next comparison."""
        rate = self.forecast_rate(sc)
        if rate is None:
            return False
        for o in self.schedules:
            m = self.measured[o.name]
            if o is not sc and m.n >= 2 and m.rate() - m.error() > FORECAST_MARGIN * rate:
                return True
        return False

    def unsure_ms(self, others: list[Schedule]) -> float:
        """How long the better mean is followed, short of a sure lead, before the others' next
        trial: ``UNSURE_MS``, or longer where their last trial was long, so that trying them again
        takes at most ``RETRIAL_SHARE`` of the time (a trial of one frame per round trip spans a
        dozen round trips: 1.5 s at 86 ms, which a 4 s wait would repeat every 5.5 s)."""
        last = max((self._trial_ran.get(sc.name, 0.0) for sc in others), default=0.0)
        return max(UNSURE_MS, last * (1 - RETRIAL_SHARE) / RETRIAL_SHARE)

    def _leads(self, best: Schedule, others: list[Schedule], confidence: float = CONFIDENCE) -> bool:
        """Whether ``best``'s rate beats every other's by ``confidence`` standard errors of the difference."""
        b = self.measured[best.name]
        for sc in others:
            o = self.measured[sc.name]
            if b.rate() - o.rate() <= confidence * math.hypot(b.error(), o.error()):
                return False
        return True

    def _fit(self, x: float, y: float) -> None:
        self._x, self._y = _ema(self._x, x), _ema(self._y, y)
        self._xx, self._xy = _ema(self._xx, x * x), _ema(self._xy, x * y)
        var = self._xx - self._x ** 2
        if var > (0.05 * self._x) ** 2 + 1.0:  # frames that differ enough to tell bandwidth from latency
            self.ms_per_byte = max(0.0, (self._xy - self._x * self._y) / var)
        self.base_ms = max(0.0, self._y - self.ms_per_byte * self._x)

    # -- prediction ----------------------------------------------------------------------------
    def timing(self, build: float | None = None) -> tuple[float, float]:
        """(a frame's time from built to verdict, the spacing of its slowest stage) in ms, for the
        current schedule's build or ``build``."""
        build = ((self.build if build is None else build) or 0.0) + self.overhead
        link = self.bytes * self.ms_per_byte
        return build + self.base_ms + link + self.tail, max(build, self.tail, link, 1e-3)

    def trial_ms(self) -> float:
        """How long a trial runs at least: ``TRIAL_TRIPS`` of a frame's time from built to verdict
        (frames in flight fill over about one; a trial spans a few more), within ``TRIAL_MIN_MS``
        and ``TRIAL_MS``. At a short round trip a schedule far behind then costs a third of a
        second, not a whole one (bench/policy_flips.py, RESULTS seventh session)."""
        return min(TRIAL_MS, max(TRIAL_MIN_MS, TRIAL_TRIPS * self.timing()[0]))

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
    def schedule(self) -> Schedule:
        return self.current

    def choose(self) -> int:
        """Frames to keep in flight: the schedule's, or as many as the timing asks for (one until a
        steady frame of the schedule was measured)."""
        if self.current.frames is not None:
            return min(self.current.frames, self.max_in_flight)
        return 1 if self.build is None else self.in_flight()


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
