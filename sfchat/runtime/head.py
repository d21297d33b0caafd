"""The head node's round engine: draft, head slice, one FORWARD/VERDICT exchange per round.

Contract
--------
``HeadEngine`` deals in token ids only. ``connect(hello)`` performs the HELLO/READY handshake
over its link. ``begin(prompt_ids)`` sets the context; each ``round(...)`` is one speculative round:

1. the drafter proposes K tokens after the committed context;
2. the head slice runs every context token the target has not cached yet (the whole prompt
   on the first round, minus what an earlier turn already left in the cache), then
   ``[t0, d1..dK]``; all but the last K+1 positions travel as prefill FORWARDs, the last K+1
   as the FORWARD to verify;
3. the VERDICT's tokens are committed, cut at the first EOS, at ``max_new_tokens`` and at
   the context window.

In relay mode a lost link (tail gone, relay gone, no verdict within the round timeout) is
re-established with backoff: the round is redone after a fresh HELLO, and because the new tail
holds no context the head's own cache is marked stale so that the ordinary prefill path sends
the committed tokens again. Committed tokens never change; verdicts carry round ids and a stale
one is ignored.

Rewind needs no bookkeeping beyond the KV caches' ``written`` logs: the next round writes at
the first position whose cached token differs from the committed context, on the head and —
because the tail writes exactly what the head sends — on the tail too. Local and relay modes
differ only in the link object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
import torch

from sfchat import UserError, wire
from sfchat.events import LinkState, RoundStats
from sfchat.relay_link import LinkClosed, PeerGone
from sfchat.runtime import sampling
from sfchat.runtime.draft import Drafter
from sfchat.runtime.slices import DTYPE_NAMES, ModelSlice

PREFILL_CHUNK = 512
STALL_NOTICE_S = 3.0  # a round without a verdict for this long is reported as stalled


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


def hidden_bytes(h: torch.Tensor) -> bytes:
    return h.contiguous().view(torch.uint8).cpu().numpy().tobytes()


class HeadEngine:
    def __init__(self, head: ModelSlice, drafter: Drafter | None, link, *, max_context: int,
                 on_event=lambda event: None, reconnect=None, round_timeout: float = 60.0,
                 reconnect_timeout: float = 300.0):
        """``reconnect(timeout) -> link`` makes a new link to a tail (relay mode); without it a
        lost link is an error. ``on_event`` receives LinkState changes."""
        self.head, self.drafter, self.link = head, drafter, link
        self.k = drafter.k if drafter is not None else 0
        self.max_context = max_context
        self.on_event, self.reconnect = on_event, reconnect
        self.round_timeout, self.reconnect_timeout = round_timeout, reconnect_timeout
        self.hello: dict = {}
        self.on_progress = None
        self.tokens: list[int] = []
        self.round_id = 0
        self.device = head.device
        self.vocab = head.config.vocab_size
        self.wire_dtype = wire.DType[DTYPE_NAMES[head.dtype].upper()]

    # -- handshake -----------------------------------------------------------------------------
    def connect(self, hello: dict, on_progress=None) -> dict:
        """Send HELLO and wait for READY; PROGRESS frames go to ``on_progress(data)``."""
        self.hello, self.on_progress = hello, on_progress
        self._send(wire.encode(wire.Control(wire.MsgType.HELLO, hello)))
        while True:
            msg = self._recv()
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.READY:
                return msg.data
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.PROGRESS:
                if on_progress is not None:
                    on_progress(msg.data)
                continue
            raise LinkError(f"unexpected {msg!r} while waiting for the tail to be ready")

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
            raise LinkError(f"the tail sent a malformed frame: {exc}") from None
        if isinstance(msg, wire.Control) and msg.type is wire.MsgType.ERROR:
            error = LinkLost if msg.data.get("resync") else LinkError  # a tail that lost our context
            raise error(f"tail: {msg.data.get('message', 'unknown error')}")
        return msg

    def _recover(self, cause: LinkLost) -> None:
        """Reconnect with backoff, re-HELLO, and make the next round re-send the whole context."""
        self.on_event(LinkState("reconnecting", str(cause)))
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.5
        while True:
            self.link.close()
            try:
                self.link = self.reconnect(max(deadline - time.monotonic(), 1.0))
                self.connect(self.hello, self.on_progress)
                break
            except (LinkError, UserError, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise LinkLost(f"gave up after {self.reconnect_timeout:.0f} s of reconnecting: {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        # A tail that answered a HELLO holds no context: writing from position 0 re-primes it
        # with the committed tokens (never changed by a fault) through the ordinary prefill path.
        self.head.kv.reset()
        self.on_event(LinkState("connected", "reconnected; the context was sent again"))

    def reset(self) -> None:
        """Forget the conversation (a new chat): every cached position becomes stale."""
        self.tokens = []
        self.head.kv.reset()
        if self.drafter is not None:
            self.drafter.reset()

    # -- generation ----------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> int:
        """Make ``prompt_ids`` the context; returns how many of its positions are already cached."""
        if len(prompt_ids) >= self.max_context:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens, the context window is "
                            f"{self.max_context}: shorten it or raise --max-context")
        if not prompt_ids:
            raise UserError("the prompt is empty")
        self.tokens = list(prompt_ids)
        return min(self.head.kv.reusable(self.tokens), len(self.tokens) - 1)

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
        n = len(self.tokens)
        drafts, q_idx, q_prob = [], None, None
        if self.drafter is not None:
            gen = sampling.round_generator(s.seed, n, "draft", self.drafter.device) if s.temperature > 0 else None
            drafts, q_idx, q_prob = self.drafter.propose(self.tokens, s, gen)
        t1 = time.perf_counter()

        start = min(self.head.kv.reusable(self.tokens), n - 1)
        seq = self.tokens[start:] + drafts
        verify_from = len(seq) - (len(drafts) + 1)
        self.round_id += 1
        for i in range(0, verify_from, PREFILL_CHUNK):  # context the target has not seen yet
            piece = seq[i:min(i + PREFILL_CHUNK, verify_from)]
            self._send_forward(piece, start + i, 0, False, s, None, None)
        self._send_forward(seq[verify_from:], start + verify_from, len(drafts), True, s, q_idx, q_prob)
        t2 = time.perf_counter()

        verdict = self._await_verdict()
        t3 = time.perf_counter()
        committed, finish = self._commit(verdict.tokens, eos_ids, budget)
        tail_ms = verdict.tail_us / 1e3
        stats = RoundStats(accepted=verdict.n_accepted, committed=len(committed),
                           draft_ms=(t1 - t0) * 1e3, head_ms=(t2 - t1) * 1e3, tail_ms=tail_ms,
                           rtt_ms=max((t3 - t2) * 1e3 - tail_ms, 0.0), round_ms=(t3 - t0) * 1e3)
        return RoundOutcome(tuple(committed), verdict.n_accepted, finish, stats)

    def _send_forward(self, piece, start, n_draft, want_verdict, s, q_idx, q_prob) -> None:
        # A draft from a larger draft vocabulary has no embedding row here; any row will do: the
        # tail rejects such a draft (p = 0), so nothing computed from this position is committed.
        ids = torch.tensor(piece, dtype=torch.long, device=self.device).clamp_(max=self.vocab - 1)
        positions = torch.arange(start, start + len(piece), device=self.device)
        hidden = self.head.run(ids, positions, end=start + len(piece))
        self.head.kv.note(start, piece)
        n_q = q_idx.shape[1] if q_idx is not None and n_draft else 0
        frame = wire.Forward(
            round=self.round_id, start_pos=start, tokens=tuple(piece), hidden=hidden_bytes(hidden),
            dtype=self.wire_dtype, hidden_size=hidden.shape[-1], n_draft=n_draft,
            want_verdict=want_verdict, sampling=s, n_q=n_q,
            q_indices=q_idx.to(torch.int32).cpu().numpy().tobytes() if n_q else b"",
            q_probs=q_prob.to(torch.float32).cpu().numpy().tobytes() if n_q else b"",
        )
        self._send(wire.encode(frame))

    def _await_verdict(self) -> wire.Verdict:
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
                if msg.round == self.round_id:
                    return msg
                continue  # a stale verdict of an abandoned round: never applied
            if isinstance(msg, wire.Control) and msg.type is wire.MsgType.PROGRESS:
                continue
            raise LinkError(f"unexpected {type(msg).__name__} while waiting for a verdict")

    def _commit(self, tokens, eos_ids: set[int], budget: int):
        committed, finish = [], None
        for t in tokens:
            committed.append(t)
            if t in eos_ids:
                finish = "eos"
            elif len(committed) >= budget:
                finish = "length"
            elif len(self.tokens) + len(committed) >= self.max_context:
                finish = "context"
            if finish:
                break
        self.tokens.extend(committed)
        return committed, finish
