"""The head's round driver: moves frames over a link and owns their clocks and faults.

Contract
--------
``RoundDriver(speculator, link, policy=..., ...)`` is the only code that talks to the tail, in
local mode (a ``MemoryLink``) and relay mode alike, and depends on the ``sfchat.link.Link``
protocol alone. ``connect(hello)`` performs the HELLO/READY handshake; ``begin(prompt_ids)`` sets
the context; each ``round(s, eos_ids, budget)`` returns the outcome of one verdict of the sans-I/O
``engine.speculator.Speculator``:

    build and send frames while fewer than m are in flight  ->  wait for the oldest's verdict
        ->  take it (commit, prune the tree)

Frames in flight: a frame may be built before the verdicts of the frames before it are known;
its nodes hang anywhere in the reply's live tree (``engine.live``), so a verdict that is not the
likeliest outcome costs only the nodes below the outcomes that did not happen, never the frames
behind it. Every frame has the layout's one size; the policy (``engine.policy.PipelinePolicy``
unless one is handed in; ``max_in_flight`` bounds ``m``; 1 is one frame per round trip), fed every
verdict with the name of the schedule its frame was built under, gives the schedule each frame
is built under: ``m`` (``choose()``) and the cap on the frame's own draft steps (``schedule().steps``).
A frame goes out while others are in flight only if the tree expects it to commit
at least the policy's ``min_yield`` tokens, and its own draft steps stop once one adds less than
the policy's ``step_gain()`` to its expected yield. At most one frame is in flight over a link whose
tail computes inside ``recv`` (local mode's ``MemoryLink``, ``overlaps = False``). Output never depends on any
of it (see ``engine.speculator``).

Each ``RoundOutcome`` has honest figures, measured where they happen: ``draft_ms`` and ``head_ms``
(head slice, frame building and sending) of the frame this verdict answers when this call built
it (else 0), ``overlap_ms`` from then to the wait (building further frames), ``wait_ms`` the time blocked on the verdict after that,
``tail_ms`` the tail's own compute (from the verdict, never more than the time it took) and
``rtt_ms`` the time from sending the frame to its verdict's arrival less the tail's compute. The
parts add up to ``round_ms``, the time between two verdicts taken. ``speculated`` marks a verdict
whose frame went out while another was in flight and that committed tokens. ``draft_steps``
counts the draft steps of the frames built, ``ahead_steps`` those run while the verdict travelled.

Drafting ahead (``ahead_steps``, over a link that overlaps): while a verdict travels the head runs
up to that many draft steps (``Speculator.grow``), looking at the link between steps, so the next
frame finds its likeliest nodes already proposed; a verdict is taken at most one step late.

Faults (relay mode): a lost link (tail gone, relay gone, no verdict within ``round_timeout``: a
deadline that nothing else the tail sends extends) during a round or the handshake is
re-established with the one backoff (``link.backoff.redial``) for up to ``reconnect_timeout``; the
round is redone after a fresh HELLO, and the new tail is re-primed through the ordinary prefill path; every new reason a try
fails for is reported. Between replies ``watch(timeout)`` notices a link that is gone at once
(``Link.closed_reason``), reports why, and dials again (see ``watch``). A stall is reported after
``STALL_NOTICE_S``. Verdicts of abandoned frames are ignored. A tail that breaks the protocol (a
malformed frame, an impossible verdict, a bad PROGRESS) ends the reply with ``LinkError``, never
a crash or a bogus token.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from sfchat import UserError
from sfchat.protocol import wire
from sfchat.events import LinkState, RoundStats
from sfchat.protocol.handshake import Hello, Ready
from sfchat.protocol.messages import Failure, Progress
from sfchat.link import Link, LinkClosed, PeerGone
from sfchat.link.backoff import Backoff, GaveUp, redial
from sfchat.engine.live import ProtocolError
from sfchat.engine.policy import PipelinePolicy
from sfchat.engine.frame import Commit, Frame
from sfchat.engine.speculator import Speculator

STALL_NOTICE_S = 3.0  # a round without a verdict for this long is reported as stalled
WATCH_BACKOFF_S = (5.0, 60.0)  # between two idle dials of a link that stays gone: the first wait, the longest


class LinkError(Exception):
    """The tail answered with an ERROR or broke the protocol: not retried."""


class LinkLost(LinkError):
    """The link to the tail is gone or stalled past the round timeout: retried by reconnecting."""


@dataclass(frozen=True)
class RoundOutcome:
    commit: Commit  # what the verdict committed (tokens after truncation, why it ended)
    stats: RoundStats


class RoundDriver:
    def __init__(self, speculator: Speculator, link: Link, *, policy: PipelinePolicy | None = None,
                 on_event=lambda event: None, reconnect=None, round_timeout: float = 60.0,
                 reconnect_timeout: float = 300.0, max_in_flight: int = 1, ahead_steps: int = 0):
        """``reconnect(timeout) -> link`` makes a new link to a tail (relay mode); without it a
        lost link is an error. ``on_event`` receives LinkState changes. ``ahead_steps``: draft
        steps the head may run while it waits for a verdict (over a link that overlaps)."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        if ahead_steps < 0:
            raise ValueError(f"ahead_steps must be at least 0, not {ahead_steps}")
        self.ahead_steps = ahead_steps if link.overlaps else 0
        self.spec, self.link = speculator, link
        self.on_event, self.reconnect = on_event, reconnect
        self.round_timeout, self.reconnect_timeout = round_timeout, reconnect_timeout
        self.hello: Hello | None = None
        self.on_progress = None
        self.flight: deque[Frame] = deque()  # sent, not answered yet; oldest first
        self.flight_sampling: wire.Sampling | None = None
        self._watch, self._watch_next = Backoff(*WATCH_BACKOFF_S), 0.0  # the idle watch's backoff (see ``watch``)
        self.policy = policy or PipelinePolicy(max_in_flight if link.overlaps else 1)

    # the engine's parts, for benchmarks and tests that look inside
    head = property(lambda self: self.spec.head)
    drafter = property(lambda self: self.spec.drafter)
    tokens = property(lambda self: self.spec.tokens)

    # -- handshake -----------------------------------------------------------------------------
    def connect(self, hello: Hello, on_progress=None) -> Ready:
        """Send HELLO and wait for READY (PROGRESS frames go to ``on_progress(stage, done, total,
        detail)``; verdicts of frames sent before it are dropped); a tail lost meanwhile is waited
        for and reconnected like one lost mid-reply. The tail holds none of the context after it."""
        self.hello, self.on_progress = hello, on_progress
        self.flight.clear()
        try:
            ready = self._handshake()
        except LinkLost as exc:
            if self.reconnect is None:
                raise
            return self._recover(exc)
        self.spec.restart()  # a HELLO leaves the tail without our context: the next frame sends it again
        return ready

    def _handshake(self) -> Ready:
        self._send(self.hello.to_frame())
        while True:
            msg = self._recv()
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.READY:
                try:
                    return Ready.parse(msg.data)
                except wire.WireError as exc:
                    raise LinkError(f"protocol error: a READY frame with {exc}") from None
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.PROGRESS:
                progress = self._parsed(Progress, msg)
                if self.on_progress is not None:
                    self.on_progress(progress.stage, progress.done, progress.total, progress.detail)
                continue
            if isinstance(msg, wire.Verdict):  # the tail answers in order: this one is for a frame sent
                continue  # before the HELLO (frames in flight when a reply ended), never applied
            raise LinkError(f"protocol error: unexpected {type(msg).__name__} while waiting for the tail to be ready")

    def _recover(self, cause: LinkLost) -> Ready:
        """Reconnect with the one backoff (``link.backoff``) and re-HELLO; the next round re-sends the
        whole context. Each new reason a try fails for (the relay refused the token, no tail came)
        is reported."""
        self.on_event(LinkState("reconnecting", str(cause)))
        self.flight.clear()
        said = None
        self._watch_next = math.inf  # given up or cancelled: the next message dials again, not the idle watch

        def failed(exc: BaseException, delay: float) -> None:
            nonlocal said
            if str(exc) != said:
                said = str(exc)
                self.on_event(LinkState("reconnecting", f"{cause}; {exc}; trying again"))

        try:
            ready = redial(self._redial, (LinkError, UserError, TimeoutError),
                           deadline=time.monotonic() + self.reconnect_timeout, on_retry=failed)
        except GaveUp as exc:
            raise LinkLost(f"gave up after {self.reconnect_timeout:.0f} s of reconnecting: {exc.last}") from None
        self.spec.restart()
        self._watch.reset()
        self._watch_next = 0.0
        self.on_event(LinkState("connected", "reconnected; the context was sent again"))
        return ready

    def _redial(self, timeout: float) -> Ready:
        """One try: a new link (the old one closed) and its handshake."""
        self.link.close()
        self.link = self.reconnect(timeout)
        return self._handshake()

    def watch(self, timeout: float) -> None:
        """Between replies: a link that is gone (the relay closed it, or stopped answering its pings)
        is reported with the reason and dialled again once, for at most ``timeout`` s; a failed
        try is reported with what went wrong (the relay refused the token ...) and tried again at
        a later call, ``WATCH_BACKOFF_S`` apart at first, then further, or by the next round. A link
        that a reply's reconnecting gave up on (or whose wait for a code was cancelled) is left
        to the next round."""
        why = self.link.closed_reason
        if why is None or self.reconnect is None or self.hello is None or time.monotonic() < self._watch_next:
            return
        cause = f"the link to the tail was lost: {why}"
        if self._watch.delay == self._watch.first:
            self.on_event(LinkState("reconnecting", cause))
        self.flight.clear()
        try:
            self._redial(timeout)
        except (LinkError, UserError, TimeoutError) as exc:
            self.link.close()  # a handshake that failed leaves no tail holding our context
            delay = self._watch.next()
            self._watch_next = time.monotonic() + delay
            self.on_event(LinkState("reconnecting", f"{cause}; {exc}; trying again in {delay:.0f} s "
                                                    "and at the next message"))
            return
        self._watch.reset()
        self._watch_next = 0.0
        self.spec.restart()
        self.on_event(LinkState("connected", "reconnected; the context is sent again with the next message"))

    # -- link ----------------------------------------------------------------------------------
    def _send(self, frame: bytes) -> None:
        try:
            self.link.send(frame)
        except LinkClosed as exc:
            raise LinkLost(f"the link to the tail was lost: {exc}") from None

    def _recv(self, timeout: float | None = None):
        """Next message from the tail; TimeoutError passes through for the caller to judge."""
        try:
            frame = self.link.recv(timeout)
        except PeerGone:
            raise LinkLost("the tail left the session") from None
        except LinkClosed as exc:
            raise LinkLost(f"the link to the tail was lost: {exc}") from None
        try:
            msg = wire.decode(frame)
        except wire.WireError as exc:
            raise LinkError(f"protocol error: the tail sent a malformed frame: {exc}") from None
        if isinstance(msg, wire.Control) and msg.type is wire.MsgType.ERROR:
            failure = self._parsed(Failure, msg)
            raise (LinkLost if failure.resync else LinkError)(f"tail: {failure.message}")  # resync: it lost our context
        return msg

    @staticmethod
    def _parsed(kind, msg: wire.Control):
        """A typed PROGRESS or ERROR, checked field by field: a LinkError for a malformed one."""
        try:
            return kind.parse(msg.data)
        except wire.WireError as exc:
            raise LinkError(f"protocol error: a {msg.type.name} frame with {exc}") from None

    # -- generation ----------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> int:
        """Make ``prompt_ids`` the context; returns how many of its positions are already cached."""
        self.flight.clear()
        return self.spec.begin(prompt_ids)

    def reset(self) -> None:
        """Forget the conversation (a new chat)."""
        self.flight.clear()
        self.spec.reset()

    def round(self, s: wire.Sampling, eos_ids: set[int], budget: int) -> RoundOutcome:
        """One verdict; a lost link is re-established and the round redone (relay mode)."""
        while True:
            try:
                return self._round(s, eos_ids, budget)
            except LinkLost as exc:
                if self.reconnect is None:
                    raise
                self._recover(exc)

    def _round(self, s: wire.Sampling, eos_ids: set[int], budget: int) -> RoundOutcome:
        t0 = time.perf_counter()
        if self.flight and self.flight_sampling != s:  # frames drawn with other settings: their tree goes
            self.flight.clear()
            self.spec.close()
        self.flight_sampling = s
        fill = self._fill(s, budget, t0)
        if not self.flight:  # nothing may be sent: the context window is full
            return RoundOutcome(Commit((), "context"), RoundStats(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0))
        first = self.flight[0]
        t3 = time.perf_counter()
        verdict, arrived, ahead = self._await_verdict(first, s, budget)
        t4 = time.perf_counter()
        commit = self._checked(self.spec.take, first, verdict, eos_ids, budget)
        in_flight = len(self.flight)
        self.flight.popleft()
        if commit.finish is not None:
            self.flight.clear()
        t5 = time.perf_counter()

        elapsed_ms = (max(arrived, first.sent_at) - first.sent_at) * 1e3
        tail_ms = min(verdict.tail_us / 1e3, elapsed_ms)  # a tail's word, never more than it took
        rtt_ms = elapsed_ms - tail_ms
        self.policy.observe(
            tokens=len(commit.tokens), sent_bytes=first.sent_bytes, rtt_ms=rtt_ms, tail_ms=tail_ms,
            build_ms=first.draft_ms + first.head_ms if first.steady else None,
            # the head's own time per verdict beyond building frames: its busy time, and the time
            # from the verdict's arrival (or the start of the wait) to having it
            overhead_ms=(t5 - t0 - (t4 - t3) + t4 - max(arrived, t3)) * 1e3 - fill.built_ms,
            round_ms=(t5 - t0) * 1e3, step_ms=first.draft_ms / first.steps if first.steps else None,
            schedule=first.schedule, forecast=self.spec.forecast(self.ahead_steps))
        depth = max((n.pos for n in first.nodes), default=0) - first.nodes[0].pos + 1 if first.nodes else 0
        stats = RoundStats(
            accepted=max(len(commit.tokens) - 1, 0), committed=len(commit.tokens), draft_ms=fill.draft_ms,
            head_ms=(fill.out_at - t0) * 1e3 - fill.draft_ms,
            tail_ms=tail_ms, rtt_ms=rtt_ms, round_ms=(t5 - t0) * 1e3,
            wait_ms=(t4 - t3) * 1e3, overlap_ms=(t3 - fill.out_at) * 1e3, speculated=first.ahead and bool(commit.tokens),
            forward_bytes=first.forward_bytes, tree_nodes=len(first.nodes), depth=depth, in_flight=in_flight,
            draft_steps=fill.steps, ahead_steps=ahead, expected=first.expected, schedule=first.schedule)
        return RoundOutcome(commit, stats)

    def _fill(self, s: wire.Sampling, budget: int, t0: float) -> "_Fill":
        """Build and send frames while fewer than the policy's number are in flight; a frame sent
        ahead of others must be expected to commit the policy's ``min_yield``."""
        fill = _Fill(out_at=t0)
        waiting_before = bool(self.flight)  # the frame this verdict answers went out in an earlier call
        m, schedule = self.policy.choose(), self.policy.schedule()
        while len(self.flight) < m:
            frame = self.spec.frame(s, budget, self.policy.min_yield if self.flight else 0.0, self.policy.step_gain(),
                                    schedule.steps)
            if frame is None:
                break
            frame.schedule = schedule.name
            frame.sent_at = time.perf_counter()  # before it goes: the tail may start on it before send returns
            for raw in frame.frames:
                self._send(raw)
            frame.ahead = bool(self.flight)
            self.flight.append(frame)
            fill.built_ms += frame.draft_ms + frame.head_ms
            fill.steps += frame.steps
            if len(self.flight) == 1 and not waiting_before:
                fill.draft_ms, fill.out_at = frame.draft_ms, time.perf_counter()  # out: what follows overlaps it
        return fill

    @staticmethod
    def _checked(fn, *args):
        try:
            return fn(*args)
        except ProtocolError as exc:
            raise LinkError(f"protocol error: {exc}") from None

    def _await_verdict(self, frame: Frame, s: wire.Sampling, budget: int) -> tuple[wire.Verdict, float, int]:
        """The verdict of ``frame``, when it arrived (``perf_counter``) and the draft steps run ahead
        meanwhile, within ``round_timeout`` of the start of the wait whatever else arrives; up to
        ``ahead_steps`` draft steps run between looks at the link while there is something to
        expand, then the wait blocks."""
        ahead = 0

        def grow() -> bool:  # one draft step ahead of need while the verdict travels
            nonlocal ahead
            ran = ahead < self.ahead_steps and self.spec.grow(s, budget)
            ahead += ran
            return ran

        start = time.monotonic()
        deadline, stalled, growing = start + self.round_timeout, False, self.ahead_steps > 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkLost(f"no verdict for {self.round_timeout:.0f} s")
            try:
                msg = self._recv(0.0 if growing else min(STALL_NOTICE_S, left))
            except TimeoutError:
                growing = growing and grow()  # nothing yet: one step ahead, then look again
                if not stalled and time.monotonic() - start >= STALL_NOTICE_S:
                    stalled = True
                    self.on_event(LinkState("stalled", f"no verdict for {time.monotonic() - start:.0f} s; waiting"))
                continue
            if isinstance(msg, wire.Verdict):
                if msg.round == frame.round_id:
                    if stalled:
                        self.on_event(LinkState("connected", f"the link recovered after "
                                                             f"{time.monotonic() - start:.0f} s"))
                    return msg, self.link.last_arrival or time.perf_counter(), ahead
                if msg.round < frame.round_id:
                    continue  # a stale verdict of an abandoned frame: never applied
                raise LinkError(f"protocol error: a verdict for frame {msg.round}, which was never sent")
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.PROGRESS:
                self._parsed(Progress, msg)
                continue
            raise LinkError(f"protocol error: unexpected {type(msg).__name__} while waiting for a verdict")


@dataclass
class _Fill:
    """What one call's frame building did: when the verdict's frame was out, the draft's share."""

    out_at: float
    built_ms: float = 0.0
    draft_ms: float = 0.0
    steps: int = 0
