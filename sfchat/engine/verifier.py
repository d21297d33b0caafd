"""The tail node's protocol engine: target layers [split, L) + final norm + lm_head, verifying.

Contract
--------
``Verifier.handle(frame, emit)`` consumes one wire frame and calls ``emit(frame)`` for each
reply (sans-I/O: the same object serves the in-memory link of local mode and the relay loop of
``sfchat --tail``). The tail needs no model flags: a HELLO names the model, revision, split,
dtype and context size; the tail loads its slice (reporting PROGRESS), checks that what it
loaded agrees with the hello, and answers READY (naming the dtype it computes in: float16
instead of the head's bfloat16 on a GPU without bf16, such as a T4; the head's hidden states
are then converted on arrival). A FORWARD fills the KV cache at the positions
it names and, when it asks for a verdict, verifies its drafts with ``sampling.verify``; a tree
FORWARD (at most the hello's ``tree_budget`` nodes, at most ``k`` deep) runs with the tree mask,
is verified by ``sampling.verify_tree``, and the accepted nodes' K/V move into place at once.

Frames in flight: every FORWARD names an epoch and the verdict tokens it ``assumes`` (the head
sent it before that verdict was known). A frame that assumes nothing opens a newer epoch; one
that assumes something is run only if the last verdict of its epoch is exactly that (then it
starts where that verdict left the context, at its last token). Otherwise the epoch is broken:
that frame and every later frame of the epoch, and of any older epoch, are dropped unread,
without a reply and without touching the KV cache; the head, which saw the same verdict, has
already rewound and opened a new epoch. A HELLO starts over at epoch 0.

Every frame is hostile until checked: each HELLO field is checked for its exact JSON type and
range before anything is allocated or opened (``handshake.Hello.parse``); a FORWARD must agree with the
hello (hidden size, dtype, K, context) and a sampled verify must carry finite, non-negative
proposal probabilities. Models are opened through ``ModelSource.open(..., allowed_dirs)``: with
``models_dirs`` (the ``sfchat --tail`` process) only hub ids and directories inside them.
A frame that breaks the protocol gets one ERROR reply and raises ``TailError``; so does any
unexpected failure while handling a frame (the tail then also forgets its context and asks the
head to resync). The verifier itself stays usable for the next frame and the next head.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from sfchat import UserError
from sfchat.protocol import wire
from sfchat.protocol.handshake import Hello, Ready, shown
from sfchat.protocol.messages import Failure, Progress
from sfchat.engine import sampling, tree
from sfchat.model.slices import ModelSlice, n_layers
from sfchat.model.devices import DTYPE_NAMES, DTYPES

UNEXPECTED = "the tail failed on this frame"


class TailError(Exception):
    """The peer broke the protocol or asked for something impossible; close the connection."""


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, rows: int, cols: int, device) -> torch.Tensor:
    """A (rows, cols) tensor from little-endian raw bytes (lengths already checked by the codec)."""
    if not raw:
        return torch.zeros(rows, cols, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(rows, cols).to(device)


class Verifier:
    def __init__(self, load: Callable[[Hello, Callable], ModelSlice], log=None):
        """``load(hello, progress)`` opens and loads the slice a hello names (a ``UserError`` when
        it cannot: refused as an ERROR); ``progress(stage, done, total, detail)`` reports to the
        head. The loader decides where models may come from and on which devices they run."""
        self.load = load
        self.k = 0
        self.log = log or (lambda msg: None)
        self.model: ModelSlice | None = None
        self.hello: Hello | None = None  # the hello whose slice is loaded
        self.rounds = 0
        self.prefill_s = 0.0  # compute spent on prefill FORWARDs since the last verdict
        self.dropped = 0  # frames of broken epochs, dropped unread
        self._epochs()

    def _epochs(self) -> None:
        self.epoch, self.broken = 0, False
        self.last: tuple[int, tuple[int, ...], int] | None = None  # (epoch, tokens, the next t0's position)

    # -- frames --------------------------------------------------------------------------------
    def handle(self, frame: bytes, emit) -> None:
        try:
            self._handle(frame, emit)
        except TailError:
            raise
        except Exception as exc:  # a check this file lacks: still an answer, and the tail stays up
            self.log(f"{UNEXPECTED}: {type(exc).__name__}: {exc}")
            if self.model is not None:
                self.model.kv.reset()
            self._fail(emit, f"{UNEXPECTED} ({type(exc).__name__}); send a fresh hello", resync=True)

    def _handle(self, frame: bytes, emit) -> None:
        try:
            msg = wire.decode(frame)
        except wire.WireError as exc:
            self._fail(emit, f"malformed frame: {exc}")
        if isinstance(msg, wire.Forward):
            self._forward(msg, emit)
        elif isinstance(msg, wire.Control) and msg.type is wire.MsgType.HELLO:
            self._hello(msg.data, emit)
        elif isinstance(msg, wire.Control) and msg.type is wire.MsgType.BYE:
            return
        else:
            self._fail(emit, f"unexpected {type(msg).__name__} {getattr(msg, 'type', '')} from the head")

    def _fail(self, emit, message: str, resync: bool = False):
        """Answer ERROR and stop; ``resync`` tells the head that this tail lost (or never had)
        its context, which a fresh HELLO and a re-sent context repair."""
        emit(Failure(message, resync).to_frame())
        raise TailError(message)

    def _hello(self, data: dict, emit) -> None:
        try:
            hello = Hello.parse(data)
        except wire.WireError as exc:
            self._fail(emit, f"incomplete hello: {exc}")
        self.k = hello.k
        t0 = time.perf_counter()
        reused = self.model is not None and hello.identity() == self.hello.identity()
        if not reused:
            self.model = self.hello = None
            try:
                self.model = self.load(hello, self._progress(emit))
            except UserError as exc:
                self._fail(emit, f"tail cannot load {shown(hello.model)}: {exc}")
        self.hello = hello  # even if refused below: it names the model now held
        cfg = self.model.config
        if n_layers(cfg) != hello.n_layers or cfg.hidden_size != hello.hidden_size:
            self._fail(emit, f"tail's model has {n_layers(cfg)} layers / hidden {cfg.hidden_size}, "
                             f"the head's {hello.n_layers} / {hello.hidden_size}: not the same model")
        # a verify is a chain of one of the hello's depths, or a tree of tree_budget nodes: a graph each
        for m, is_tree in hello.shapes():
            if hello.graphs and self.model.device.type == "cuda" and not self.model.captured(m, m, is_tree):
                self.model.capture(m, m, log=self.log, tree=is_tree)
        if not hello.graphs:
            self.model.graphs.clear()
        self.model.kv.reset()
        self.prefill_s = 0.0
        self._epochs()
        ready = Ready(n_layers=n_layers(cfg), hidden_size=cfg.hidden_size, device=str(self.model.device),
                      dtype=DTYPE_NAMES[self.model.dtype], load_s=round(time.perf_counter() - t0, 3), reused=reused)
        self.log(f"ready: {hello.model} layers [{hello.split}, {n_layers(cfg)}) on {self.model.device}")
        emit(ready.to_frame())

    def _in_epoch(self, msg: wire.Forward, emit) -> bool:
        """Whether ``msg`` is to be run: False for a frame of a broken or older epoch (dropped)."""
        if msg.epoch < self.epoch or (msg.epoch == self.epoch and self.broken):
            return False
        if msg.epoch > self.epoch:
            if msg.assumes:
                self._fail(emit, f"the first frame of epoch {msg.epoch} assumes a verdict of that epoch")
            self.epoch, self.broken = msg.epoch, False
            return True
        if not msg.assumes:
            return True
        if self.last is None or self.last[0] != self.epoch or self.last[1] != msg.assumes:
            self.broken = True  # the head assumed an outcome that did not happen
            return False
        if msg.start_pos != self.last[2] or msg.tokens[0] != msg.assumes[-1]:
            self._fail(emit, f"a frame assuming a verdict that ends at position {self.last[2]} starts at "
                             f"{msg.start_pos} with another token")
        self.last = None  # one frame follows a verdict
        return True

    def _progress(self, emit):
        """A loader's progress callback: PROGRESS frames to the head, at most ten a second."""
        last = [0.0]

        def progress(stage, done, total, detail):
            now = time.monotonic()
            if done == total or now - last[0] > 0.1:
                last[0] = now
                emit(Progress(stage, done, total, detail or "").to_frame())

        return progress

    def _forward(self, msg: wire.Forward, emit) -> None:
        if self.model is None:
            self._fail(emit, "FORWARD before HELLO", resync=True)
        m = self.model
        device = m.device
        n = len(msg.tokens)
        sent = DTYPES[msg.dtype.name.lower()]
        if msg.hidden_size != m.config.hidden_size or DTYPE_NAMES[sent] not in (DTYPE_NAMES[m.dtype],
                                                                              self.hello.dtype):
            self._fail(emit, f"hidden states of size {msg.hidden_size}/{DTYPE_NAMES[sent]} do not match "
                             f"the tail's {m.config.hidden_size}/{DTYPE_NAMES[m.dtype]}")
        if msg.start_pos + n > m.kv.max_len:
            self._fail(emit, f"positions up to {msg.start_pos + n} exceed the context of {m.kv.max_len}")
        k = msg.n_draft
        depths = None
        if msg.parents is not None:
            budget = self.hello.tree_budget
            if k > budget:
                self._fail(emit, f"a tree of {k} nodes; the hello announced at most {budget}")
            depths = wire.tree_depths(msg.parents)
            deepest = max(depths)
            if deepest > self.k:
                self._fail(emit, f"a tree {deepest} deep; the hello announced at most {self.k}")
        elif k > self.k:
            self._fail(emit, f"a FORWARD with {k} drafts; the hello announced at most {self.k}")
        sampled = msg.want_verdict and k > 0 and msg.sampling.temperature > 0 and msg.parents is None
        if sampled and msg.n_q == 0:
            self._fail(emit, "a sampled verify without the draft's proposal distributions (n_q = 0)")
        q_probs = torch.frombuffer(bytearray(msg.q_probs), dtype=torch.float32) if sampled else None
        if q_probs is not None and not bool(torch.isfinite(q_probs).all() and (q_probs >= 0).all()):
            self._fail(emit, "draft proposal probabilities that are not finite and non-negative")
        if not self._in_epoch(msg, emit):
            self.dropped += 1
            return
        if msg.start_pos > len(m.kv.written):
            self._fail(emit, f"context hole: the tail holds {len(m.kv.written)} positions, the head "
                             f"wrote at {msg.start_pos} (did the tail restart?)", resync=True)
        t0 = time.perf_counter()
        hidden = tensor_from_bytes(msg.hidden, sent, n, msg.hidden_size, device).to(m.dtype)
        positions = torch.arange(msg.start_pos, msg.start_pos + n, device=device)
        mask = tree.mask(msg.parents, msg.start_pos, device, depths) if depths is not None else None
        logits = m.run(hidden, positions, n_logits=k + 1 if msg.want_verdict else 1, end=msg.start_pos + n,
                       tree=mask)
        m.kv.note(msg.start_pos, msg.tokens[:1] if mask is not None else msg.tokens)  # tree nodes: scratch
        if not msg.want_verdict:
            self.prefill_s += time.perf_counter() - t0
            return
        gen = sampling.round_generator(msg.sampling.seed, msg.start_pos, "verify", device) \
            if msg.sampling.temperature > 0 else None
        path = None
        if mask is not None:
            path, tokens = sampling.verify_tree(logits, msg.parents, msg.tokens[1:], msg.sampling, gen)
            n_acc = len(path)
            m.keep([msg.start_pos + i for i in path], msg.start_pos + 1, tokens[:-1])
        else:
            drafts = torch.tensor(msg.tokens[n - k:], dtype=torch.long)  # verify copies it without a sync
            q_idx = tensor_from_bytes(msg.q_indices, torch.int32, k, msg.n_q, device)
            q_prob = tensor_from_bytes(msg.q_probs, torch.float32, k, msg.n_q, device)
            n_acc, tokens = sampling.verify(logits, drafts, msg.sampling, q_idx, q_prob, gen)
        # the round's whole compute here, its prefill chunks included: the head subtracts it from
        # the round trip, so that RTT is the network's alone
        tail_us = min(int((time.perf_counter() - t0 + self.prefill_s) * 1e6), 2 ** 32 - 1)
        self.prefill_s = 0.0
        self.rounds += 1
        self.last = (self.epoch, tuple(tokens), msg.start_pos + len(tokens))
        emit(wire.encode(wire.Verdict(msg.round, msg.start_pos, n_acc, tuple(tokens), tail_us,
                                      tuple(path) if path is not None else None)))
