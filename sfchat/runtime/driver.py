"""The head's round driver: moves a round's frames over a link and owns its clocks and faults.

Contract
--------
``RoundDriver(rounds, link, ...)`` is the only code that talks to the tail, in local mode (a
``MemoryLink``) and relay mode alike. ``connect(hello)`` performs the HELLO/READY handshake;
``begin(prompt_ids)`` sets the context; each ``round(s, eos_ids, budget)`` runs one round of the
sans-I/O ``round.HeadRound``:

    plan (draft + head slice)  ->  send  ->  [prepare the next round]  ->  wait  ->  take the verdict

and returns a ``RoundOutcome`` with honest figures, each measured where it happens:
``draft_ms`` and ``head_ms`` (head slice, frame building and sending) on the critical path,
``overlap_ms`` the work done after sending while the verdict travels, ``wait_ms`` the time
blocked on the verdict after that, ``tail_ms`` the tail's own compute (from the verdict) and
``rtt_ms`` the time from sending to the verdict's arrival less the tail's compute. The parts add
up to ``round_ms``. When a round was prepared under the wait and the verdict is the outcome it
assumed, the next round sends the prepared frame at once (``prepared`` in its stats) and its
draft and head compute are off the critical path.

Preparing pays only while the verdict is in flight: never over a link whose tail computes inside
``recv`` (local mode's ``MemoryLink``, ``overlaps = False``); over a relay, when ``policy.
PreparePolicy`` finds from the measured rounds that a hit saves more than preparing delays
(``prepare="auto"``; "on" / "off" force it). Output never depends on it (see ``round``).

Faults (relay mode): a lost link (tail gone, relay gone, no verdict within ``round_timeout``)
during a round or during the handshake is re-established with backoff for up to
``reconnect_timeout``; the round is redone after a fresh HELLO, and the new tail is re-primed
through the ordinary prefill path. A stall is reported after ``STALL_NOTICE_S``. Verdicts of
abandoned rounds are ignored. A tail that breaks the protocol (a malformed frame, an impossible
verdict, a bad PROGRESS) ends the reply with ``LinkError``, never a crash or a bogus token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sfchat import UserError, wire
from sfchat.events import LinkState, RoundStats
from sfchat.handshake import Hello, Ready
from sfchat.relay_link import LinkClosed, PeerGone
from sfchat.runtime.policy import PreparePolicy
from sfchat.runtime.round import HeadRound, Plan, ProtocolError

STALL_NOTICE_S = 3.0  # a round without a verdict for this long is reported as stalled
MAX_TEXT = 500  # characters of a tail's ERROR or PROGRESS text kept


class LinkError(Exception):
    """The tail answered with an ERROR or broke the protocol: not retried."""


class LinkLost(LinkError):
    """The link to the tail is gone or stalled past the round timeout: retried by reconnecting."""


@dataclass(frozen=True)
class RoundOutcome:
    tokens: tuple[int, ...]  # committed this round (after truncation)
    accepted: int
    finish: str | None  # None, "eos", "length" or "context"
    stats: RoundStats


def progress_fields(data: dict) -> tuple[str, int, int, str]:
    """(stage, done, total, detail) of a tail's PROGRESS, checked: ProtocolError otherwise."""
    stage, done, total, detail = (data.get(k) for k in ("stage", "done", "total", "detail"))
    ints = all(type(x) is int and 0 <= x < 1 << 62 for x in (done, total))
    if not (ints and isinstance(stage, str) and isinstance(detail, (str, type(None)))):
        raise ProtocolError("a PROGRESS frame with malformed fields")
    return stage[:64], done, total, (detail or "")[:MAX_TEXT]


class RoundDriver:
    def __init__(self, rounds: HeadRound, link, *, on_event=lambda event: None, reconnect=None,
                 round_timeout: float = 60.0, reconnect_timeout: float = 300.0, prepare: str = "auto"):
        """``reconnect(timeout) -> link`` makes a new link to a tail (relay mode); without it a
        lost link is an error. ``on_event`` receives LinkState changes."""
        if prepare not in ("auto", "on", "off"):
            raise ValueError(f"prepare must be auto, on or off, not {prepare!r}")
        self.rounds, self.link = rounds, link
        self.on_event, self.reconnect = on_event, reconnect
        self.round_timeout, self.reconnect_timeout = round_timeout, reconnect_timeout
        self.prepare_mode = prepare
        self.hello: Hello | None = None
        self.on_progress = None
        self.pending: tuple[Plan, wire.Sampling] | None = None  # the prepared next round
        self.policy = PreparePolicy()

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
                fields = self._checked(progress_fields, msg.data)
                if self.on_progress is not None:
                    self.on_progress(*fields)
                continue
            raise LinkError(f"protocol error: unexpected {type(msg).__name__} while waiting for the tail to be ready")

    def _recover(self, cause: LinkLost) -> Ready:
        """Reconnect with backoff and re-HELLO; the next round re-sends the whole context."""
        self.on_event(LinkState("reconnecting", str(cause)))
        self.pending = None
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
        except (LinkClosed, ConnectionError) as exc:
            raise LinkLost(f"the link to the tail was lost: {exc}") from None

    def _recv(self, timeout: float | None = None):
        """Next message from the tail; TimeoutError passes through for the caller to judge."""
        try:
            frame = self.link.recv(timeout)
        except PeerGone:
            raise LinkLost("the tail left the session") from None
        except (LinkClosed, ConnectionError) as exc:
            raise LinkLost(f"the link to the tail was lost: {exc}") from None
        try:
            msg = wire.decode(frame)
        except wire.WireError as exc:
            raise LinkError(f"protocol error: the tail sent a malformed frame: {exc}") from None
        if isinstance(msg, wire.Control) and msg.type is wire.MsgType.ERROR:
            text = msg.data.get("message")
            text = text[:MAX_TEXT] if isinstance(text, str) else "unknown error"
            error = LinkLost if msg.data.get("resync") is True else LinkError  # a tail that lost our context
            raise error(f"tail: {text}")
        return msg

    @staticmethod
    def _checked(fn, *args):
        try:
            return fn(*args)
        except ProtocolError as exc:
            raise LinkError(f"protocol error: {exc}") from None

    # -- generation ----------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> int:
        """Make ``prompt_ids`` the context; returns how many of its positions are already cached."""
        self.pending = None
        return self.rounds.begin(prompt_ids)

    def reset(self) -> None:
        """Forget the conversation (a new chat)."""
        self.pending = None
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
        prepared = self.pending is not None and self.pending[1] == s
        plan = self.pending[0] if prepared else self.rounds.plan(s)
        self.pending = None
        for frame in plan.frames:
            self._send(frame)
        t2 = time.perf_counter()
        ahead = None
        if self._worth_preparing() and self.rounds.can_prepare(plan, budget):
            ahead = self.rounds.prepare(plan, s)
        t3 = time.perf_counter()
        verdict, arrived = self._await_verdict(plan.round_id)
        t4 = time.perf_counter()
        commit = self._checked(self.rounds.take, plan, verdict, eos_ids, budget)
        hit = self.rounds.prepared_for(ahead, plan, commit)
        self.pending = (hit, s) if hit is not None else None
        t5 = time.perf_counter()

        tail_ms = verdict.tail_us / 1e3
        rtt_ms = (max(arrived, t2) - t2) * 1e3 - tail_ms
        all_accepted = bool(plan.drafts) and commit.accepted == plan.depth
        self.policy.observe(
            latency_ms=rtt_ms + tail_ms, compute_ms=None if prepared else plan.draft_ms + plan.head_ms,
            all_accepted=all_accepted, prepared_ms=(t4 - t2) * 1e3 if ahead is not None else None,
            guess_right=verdict.tokens[-1] == ahead.guess if ahead is not None and all_accepted else None)
        stats = RoundStats(
            accepted=commit.accepted, committed=len(commit.tokens),
            draft_ms=0.0 if prepared else plan.draft_ms,
            head_ms=(t2 - t0) * 1e3 - (0.0 if prepared else plan.draft_ms),
            tail_ms=tail_ms, rtt_ms=rtt_ms, round_ms=(t5 - t0) * 1e3,
            wait_ms=(t4 - t3) * 1e3, overlap_ms=(t3 - t2) * 1e3, prepared=prepared,
            forward_bytes=plan.forward_bytes, tree_nodes=len(plan.tree) if plan.tree is not None else 0,
            depth=plan.depth)
        return RoundOutcome(commit.tokens, commit.accepted, commit.finish, stats)

    def _worth_preparing(self) -> bool:
        if self.prepare_mode != "auto":
            return self.prepare_mode == "on"
        return getattr(self.link, "overlaps", True) and self.policy.worth()

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
                    return msg, getattr(self.link, "last_arrival", None) or time.perf_counter()
                if msg.round < round_id:
                    continue  # a stale verdict of an abandoned round: never applied
                raise LinkError(f"protocol error: a verdict for round {msg.round}, which was never sent")
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.PROGRESS:
                self._checked(progress_fields, msg.data)
                continue
            raise LinkError(f"protocol error: unexpected {type(msg).__name__} while waiting for a verdict")
