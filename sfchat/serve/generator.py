"""The generation thread: the server's ``node.worker.CudaThread``, which owns the head.

Contract
--------
``GenerationThread(settings, metrics, max_queue, open_head=..., on_event=...)``. ``start()`` starts
the thread, which opens the head with ``open_head(settings, on_event)`` (by default
``worker.open_head``: over a relay link in relay mode, in-process otherwise) and returns the
``RuntimeReady`` figures once it is loaded, or raises the load's ``UserError`` in the caller.
Loading, every round and every reply run on that thread alone.

``submit(job)`` queues a ``Job`` without blocking; ``QueueFull`` when ``max_queue`` jobs already
wait (the one being generated does not count). The thread reports each job's progress by
calling ``job.deliver(item)`` from the generation thread, with typed items

* ``Started(event, queued_s)``: the engine's ``ReplyStarted`` and the time the job waited,
* ``Text(text)``: the reply's next text, stop strings already cut (``StopMatcher``),
* ``Finished(outcome)`` or ``Failed(status, message)``: one of the two ends every job.

``job.cancel()`` (a client went away) is seen between rounds: the reply ends as "cancelled"; a
job cancelled while it waits is dropped when its turn comes. ``encode(messages)`` turns a
conversation into prompt ids on the caller's thread (tokenizer only, under a lock: encoding
never changes the fast tokenizer's padding or truncation state, so the generation thread's
decoding may run beside it); a caller that cannot have the lock within ``ENCODE_WAIT_S`` gets
``TokenizerBusy``. A follow-up from the same client (``job.client``, its address) whose prompt
extends the previous conversation reuses the KV cache through the engine; a job from another
client starts from a fresh cache, so that nothing of one client's conversation (a secret
system prompt) shows in another's ``cached_tokens``, figures or timing. Failure messages that
carry text from the tail are ``plaintext.plain``. ``close()`` ends the thread after the current
round.

Pairing codes (relay mode): the head tries a code once per time it is given one
(``node.connect``). ``set_code(code)`` gives the running server a new one, from any thread (a
notebook cell): the next time the head needs a code (a tail that does not resume, a code that was
refused) it pairs with it, without a restart. Until then a request that needs a code fails with
a 503 that says why and how to give one; the server never waits for one.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import inspect

from sfchat import UserError
from sfchat.config import Settings
from sfchat.link.pairing import require_secret
from sfchat.link.secure import CodeNeeded, SecretMismatch
from sfchat.events import LinkState, ReplyFinished, ReplyStarted, TokensCommitted
from sfchat.node.worker import STOP, CudaThread, open_head
from sfchat.params import GenParams
from sfchat.plaintext import plain
from sfchat.serve.metrics import ServerMetrics
from sfchat.serve.stops import StopMatcher


ENCODE_WAIT_S = 30.0  # the longest a request waits for the tokenizer (each holder is bounded: prompts.render)
HOW_TO_GIVE_A_CODE = "give the running server the code the tail printed: server.set_code(CODE)"


class QueueFull(Exception):
    pass


class TokenizerBusy(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    gen: GenParams  # each value None: the head's setting, else the model's default
    stops: tuple[str, ...]
    deliver: Callable[[tuple], None]
    client: str = ""  # who asks (an address): only its own conversation's KV cache is reused
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # "eos", "stop", "length", "context", "cancelled"
    text: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    figures: dict  # sfchat's own: tokens per round, tok/s, RTT, ...


@dataclass(frozen=True)
class Started:
    event: ReplyStarted
    queued_s: float


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Finished:
    outcome: Outcome


@dataclass(frozen=True)
class Failed:
    status: int  # the HTTP status the request ends with
    message: str


class GenerationThread(CudaThread):
    name = "sfchat-generation"

    def __init__(self, settings: Settings, metrics: ServerMetrics, max_queue: int = 16,
                 open_head: Callable = open_head, on_event: Callable = lambda e: None):
        super().__init__(settings, open_head, max(1, max_queue))
        self.metrics, self.report = metrics, on_event
        self.info = None
        self.tokenizer_lock = threading.Lock()
        self.current: Job | None = None
        self.cache_client: str | None = None  # whose conversation the KV cache holds
        self._code_lock = threading.Lock()
        self._code: str | None = None  # given by set_code, not yet handed to the head

    # -- the caller's side ----------------------------------------------------------------------
    def start(self, timeout: float | None = None):  # type: ignore[override]
        super().start()
        if not self.loaded.wait(timeout):
            raise UserError(f"the models did not load within {timeout} s")
        if self.load_error is not None:
            raise self.load_error
        self.info = self.head.info
        return self.info

    def encode(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer_lock.acquire(timeout=ENCODE_WAIT_S):
            raise TokenizerBusy(f"the tokenizer was busy with other requests for {ENCODE_WAIT_S:g} s; retry later")
        try:
            return self.head.encode(list(messages))
        finally:
            self.tokenizer_lock.release()

    def set_code(self, code: str) -> None:
        """The pairing code for the next time the head needs one (a UserError for a code too short)."""
        require_secret(code, False)
        with self._code_lock:
            self._code = code

    def submit(self, job: Job) -> None:
        try:
            self.requests.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None
        self.metrics.queue_depth.set(self.requests.qsize())

    def close(self) -> None:
        job = self.current
        if job is not None:
            job.cancel()
        while True:  # the thread takes the next job at once: make it the end
            try:
                waiting = self.requests.get_nowait()
            except queue.Empty:
                break
            if waiting is not STOP:
                waiting.deliver(Failed(503, "the server is shutting down"))
        try:
            self.requests.put_nowait(STOP)
        except queue.Full:
            pass
        self.join(timeout=30)

    # -- the generation thread ------------------------------------------------------------------
    def open(self):
        if "ask_code" in inspect.signature(self.open_head).parameters:
            return self.open_head(self.settings, self.on_event, ask_code=self._ask_code)
        return self.open_head(self.settings, self.on_event)

    def _ask_code(self, reason: str) -> str:
        """The code given with ``set_code`` since the head last took one; CodeNeeded without one
        (while loading: the reason alone, so that the load fails with it)."""
        with self._code_lock:
            code, self._code = self._code, None
        if code is None:
            raise CodeNeeded(f"{reason}; {HOW_TO_GIVE_A_CODE}" if self.loaded.is_set() else reason)
        return code

    def on_event(self, ev) -> None:
        if isinstance(ev, LinkState):
            self.metrics.link(ev.state)
        self.report(ev)

    def serve(self, job: Job) -> bool:
        self.metrics.queue_depth.set(self.requests.qsize())
        if job.cancelled.is_set():
            self.metrics.reply("cancelled")
            return True
        self.current = job
        self.metrics.generating.set(1)
        try:
            self._generate(job)
        finally:
            self.current = None
            self.metrics.generating.set(0)
        return True

    def _generate(self, job: Job) -> None:
        try:
            outcome = self._reply(job)
        except UserError as exc:
            self.metrics.reply("failed")
            job.deliver(Failed(400, plain(exc)))
        except SecretMismatch as exc:  # no tail paired: says why, and what to do
            self.metrics.reply("failed")
            job.deliver(Failed(503, plain(exc)))
        except Exception as exc:  # the link died for good, or a bug: this request fails, the server stays
            self.metrics.reply("failed")
            job.deliver(Failed(503, f"generation failed: {type(exc).__name__}: {plain(exc)}"))
            try:
                self.head.new_chat()  # a half-done round leaves nothing trustworthy cached
            except Exception:
                pass
        else:
            self.metrics.reply(outcome.finish_reason, outcome.prompt_tokens, outcome.cached_tokens,
                               outcome.completion_tokens, outcome.figures["tps"], outcome.figures["ttft_s"])
            job.deliver(Finished(outcome))

    def _reply(self, job: Job) -> Outcome:
        session = self.head
        if job.client != self.cache_client:  # another client's conversation: nothing of it is reused
            session.new_chat()
            self.cache_client = job.client
        queued_s = time.perf_counter() - job.submitted
        stops = StopMatcher(job.stops)
        sampling = session.sampling(job.gen)
        tokens: list[int] = []
        started = final = None
        for ev in session.reply(job.prompt_ids, job.max_tokens, sampling,
                                lambda: job.cancelled.is_set() or stops.hit):
            if isinstance(ev, ReplyStarted):
                started = ev
                job.deliver(Started(ev, queued_s))
            elif isinstance(ev, TokensCommitted):
                self.metrics.round(ev.stats.committed, ev.stats.rtt_ms)
                tokens.extend(ev.token_ids)
                if piece := stops.push(ev.text):
                    job.deliver(Text(piece))
            elif isinstance(ev, ReplyFinished):
                final = ev
        reason = final.finish_reason
        n = len(tokens)
        if stops.hit:
            reason, n = "stop", self._tokens_until(tokens, stops.end)
        elif reason != "cancelled" and (piece := stops.flush()):
            job.deliver(Text(piece))
        figures = {**final.figures(), "queued_s": queued_s, "prefill_tokens": started.prefill_tokens,
                   "k": self.info.k, "mode": self.info.mode}
        return Outcome(reason, stops.text, n, len(job.prompt_ids), started.reused_tokens, figures)

    def _tokens_until(self, tokens: list[int], end: int) -> int:
        """The fewest leading tokens of the reply whose text reaches ``end`` characters (the stop's end)."""
        decode = self.head.tokenizer.decode
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(tokens[:mid], skip_special_tokens=True)) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo
