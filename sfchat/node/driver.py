"""The head's round driver: moves a round's frames over a link and owns its clocks and faults.

Contract
--------
``RoundDriver(rounds, link, ...)`` is the only code that talks to the tail, in local mode (a
``MemoryLink``) and relay mode alike. ``connect(hello)`` performs the HELLO/READY handshake;
``begin(prompt_ids)`` sets the context; each ``round(s, eos_ids, budget)`` returns the outcome of
one verdict of the sans-I/O ``round.HeadRound``:

    [plan (draft + head slice), send]  ->  speculate and send while frames in flight < m
        ->  wait for the oldest frame's verdict  ->  take it  ->  [drop the rest if it broke them]

Frames in flight: the rounds sent but not answered yet, oldest first, each built on the
likeliest outcome of the one before (``HeadRound.speculate``). When a verdict is not the
outcome the next frame assumed (or the reply ends, or the sampling changes), the rest are
dropped: the tail drops them too, as a broken epoch, and the next round is planned from the
committed context in a new epoch. The shape of each round and ``m`` come from
``policy.SpeculationPolicy`` (``max_in_flight`` bounds ``m``; 1 is the sequential round), fed
every verdict. Nothing is in flight over a link whose tail computes inside ``recv`` (local
mode's ``MemoryLink``, ``overlaps = False``). Output never depends on any of it (see ``round``).

Each ``RoundOutcome`` has honest figures, measured where they happen: ``draft_ms`` and ``head_ms``
(head slice, frame building and sending) of a round planned in this call, ``overlap_ms`` the
rounds speculated while verdicts travel, ``wait_ms`` the time blocked on the verdict after that,
``tail_ms`` the tail's own compute (from the verdict) and ``rtt_ms`` the time from sending the
round to its verdict's arrival less the tail's compute. The parts add up to ``round_ms``, the
time between two verdicts taken. ``speculated`` marks a round whose frame went out before the
verdict before it was known, and whose assumption held.

Faults (relay mode): a lost link (tail gone, relay gone, no verdict within ``round_timeout``)
during a round or during the handshake is re-established with backoff for up to
``reconnect_timeout``; the round is redone after a fresh HELLO, and the new tail is re-primed
through the ordinary prefill path. A stall is reported after ``STALL_NOTICE_S``. Verdicts of
abandoned rounds are ignored. A tail that breaks the protocol (a malformed frame, an impossible
verdict, a bad PROGRESS) ends the reply with ``LinkError``, never a crash or a bogus token.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from sfchat import UserError
from sfchat.protocol import wire
from sfchat.events import LinkState, RoundStats
from sfchat.protocol.handshake import Hello, Ready
from sfchat.protocol.messages import Failure, Progress
from sfchat.link import LinkClosed, PeerGone
from sfchat.engine.policy import SpeculationPolicy
from sfchat.engine.round import Commit, HeadRound, Plan, ProtocolError

STALL_NOTICE_S = 3.0  # a round without a verdict for this long is reported as stalled


class LinkError(Exception):
    """The tail answered with an ERROR or broke the protocol: not retried."""


class LinkLost(LinkError):
    """The link to the tail is gone or stalled past the round timeout: retried by reconnecting."""


@dataclass(frozen=True)
class RoundOutcome:
    commit: Commit  # what the verdict committed (tokens after truncation, drafts accepted, why it ended)
    stats: RoundStats


class RoundDriver:
    def __init__(self, rounds: HeadRound, link, *, on_event=lambda event: None, reconnect=None,
                 round_timeout: float = 60.0, reconnect_timeout: float = 300.0, max_in_flight: int = 1):
        """``reconnect(timeout) -> link`` makes a new link to a tail (relay mode); without it a
        lost link is an error. ``on_event`` receives LinkState changes."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        self.rounds, self.link = rounds, link
        self.on_event, self.reconnect = on_event, reconnect
        self.round_timeout, self.reconnect_timeout = round_timeout, reconnect_timeout
        self.hello: Hello | None = None
        self.on_progress = None
        self.flight: deque[Plan] = deque()  # sent, not answered yet; oldest first
        self.flight_sampling: wire.Sampling | None = None
        self.max_in_flight = max_in_flight
        self.policy = self.new_policy()

    def new_policy(self) -> SpeculationPolicy:
        return SpeculationPolicy(self.rounds.shapes, self.max_in_flight if self.link.overlaps else 1)

    # what the rest of the head reads of the engine
    head = property(lambda self: self.rounds.head)
    drafter = property(lambda self: self.rounds.drafter)
    k = property(lambda self: self.rounds.k)
    tokens = property(lambda self: self.rounds.tokens)

    # -- handshake -----------------------------------------------------------------------------
    def connect(self, hello: Hello, on_progress=None) -> Ready:
        """Send HELLO and wait for READY (PROGRESS frames go to ``on_progress(stage, done, total,
        detail)``); a tail lost meanwhile is waited for and reconnected like one lost mid-reply."""
        self.hello, self.on_progress = hello, on_progress
        try:
            return self._handshake()
        except LinkLost as exc:
            if self.reconnect is None:
                raise
            return self._recover(exc)

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
            raise LinkError(f"protocol error: unexpected {type(msg).__name__} while waiting for the tail to be ready")

    def _recover(self, cause: LinkLost) -> Ready:
        """Reconnect with backoff and re-HELLO; the next round re-sends the whole context."""
        self.on_event(LinkState("reconnecting", str(cause)))
        self.flight.clear()
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.5
        while True:
            self.link.close()
            try:
                self.link = self.reconnect(max(deadline - time.monotonic(), 1.0))
                ready = self._handshake()
                break
            except (LinkError, UserError, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise LinkLost(f"gave up after {self.reconnect_timeout:.0f} s of reconnecting: {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.rounds.forget_tail()
        self.on_event(LinkState("connected", "reconnected; the context was sent again"))
        return ready

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

    @staticmethod
    def _checked(fn, *args):
        try:
            return fn(*args)
        except ProtocolError as exc:
            raise LinkError(f"protocol error: {exc}") from None

    # -- generation ----------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> int:
        """Make ``prompt_ids`` the context; returns how many of its positions are already cached."""
        self.flight.clear()
        return self.rounds.begin(prompt_ids)

    def reset(self) -> None:
        """Forget the conversation (a new chat)."""
        self.flight.clear()
        self.rounds.reset()

    def round(self, s: wire.Sampling, eos_ids: set[int], budget: int) -> RoundOutcome:
        """One round; a lost link is re-established and the round redone (relay mode)."""
        while True:
            try:
                return self._round(s, eos_ids, budget)
            except LinkLost as exc:
                if self.reconnect is None:
                    raise
                self._recover(exc)

    def _round(self, s: wire.Sampling, eos_ids: set[int], budget: int) -> RoundOutcome:
        t0 = time.perf_counter()
        if self.flight and self.flight_sampling != s:
            self.flight.clear()
        speculated = bool(self.flight)
        planned = None
        if not self.flight:
            shape, _ = self.policy.choose()
            planned = self.rounds.plan(s, shape)
            self._send_plan(planned)
            self.flight_sampling = s
        first = self.flight[0]
        built = planned.draft_ms + planned.head_ms if planned else 0.0
        t2 = time.perf_counter()
        while True:  # speculation in flight: the likeliest outcome of the newest frame, sent now
            shape, m = self.policy.choose()
            last = self.flight[-1]
            if len(self.flight) >= m or not self.rounds.can_speculate(last, budget, eos_ids):
                break
            ahead = self.rounds.speculate(last, s, shape)
            self._send_plan(ahead)
            built += ahead.draft_ms + ahead.head_ms
        t3 = time.perf_counter()
        verdict, arrived = self._await_verdict(first.round_id)
        t4 = time.perf_counter()
        commit = self._checked(self.rounds.take, first, verdict, eos_ids, budget)
        in_flight = len(self.flight)
        self.flight.popleft()
        holds = self.rounds.holds(first, verdict)
        if self.flight and (commit.finish is not None or not holds):
            self.flight.clear()  # frames built on an outcome that did not happen: the tail drops them too
        t5 = time.perf_counter()

        tail_ms = verdict.tail_us / 1e3
        rtt_ms = (max(arrived, first.sent_at) - first.sent_at) * 1e3 - tail_ms
        full = list(verdict.path) == first.likeliest()
        self.policy.observe(
            first.shape, accepted=commit.accepted, full=full, sent_bytes=first.sent_bytes, rtt_ms=rtt_ms,
            tail_ms=tail_ms, compute_ms=first.draft_ms + first.head_ms if first.steady else None,
            guess_right=holds if first.outcome is not None and full else None,
            # the head's own time per verdict beyond drafting and the head slice: its busy time,
            # and the time from the verdict's arrival (or the start of the wait) to having it
            overhead_ms=(t5 - t0 - (t4 - t3) + t4 - max(arrived, t3)) * 1e3 - built)
        stats = RoundStats(
            accepted=commit.accepted, committed=len(commit.tokens),
            draft_ms=planned.draft_ms if planned else 0.0,
            head_ms=(t2 - t0) * 1e3 - (planned.draft_ms if planned else 0.0),
            tail_ms=tail_ms, rtt_ms=rtt_ms, round_ms=(t5 - t0) * 1e3,
            wait_ms=(t4 - t3) * 1e3, overlap_ms=(t3 - t2) * 1e3, speculated=speculated,
            forward_bytes=first.forward_bytes, tree_nodes=len(first.tree) if first.tree is not None else 0,
            depth=first.depth, in_flight=in_flight)
        return RoundOutcome(commit, stats)

    def _send_plan(self, plan: Plan) -> None:
        for frame in plan.frames:
            self._send(frame)
        plan.sent_at = time.perf_counter()
        self.flight.append(plan)

    def _await_verdict(self, round_id: int) -> tuple[wire.Verdict, float]:
        """The verdict of ``round_id`` and when it arrived (``perf_counter``)."""
        waited = 0.0
        while True:
            try:
                msg = self._recv(STALL_NOTICE_S)
            except TimeoutError:
                waited += STALL_NOTICE_S
                if waited == STALL_NOTICE_S:
                    self.on_event(LinkState("stalled", f"no verdict for {waited:.0f} s; waiting"))
                if waited >= self.round_timeout:
                    raise LinkLost(f"no verdict for {waited:.0f} s") from None
                continue
            if waited:
                self.on_event(LinkState("connected", f"the link recovered after {waited:.0f} s"))
                waited = 0.0
            if isinstance(msg, wire.Verdict):
                if msg.round == round_id:
                    return msg, self.link.last_arrival or time.perf_counter()
                if msg.round < round_id:
                    continue  # a stale verdict of an abandoned round: never applied
                raise LinkError(f"protocol error: a verdict for round {msg.round}, which was never sent")
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.PROGRESS:
                self._parsed(Progress, msg)
                continue
            raise LinkError(f"protocol error: unexpected {type(msg).__name__} while waiting for a verdict")
