"""The tail node's protocol engine: target layers [split, L) + final norm + lm_head, verifying.

Contract
--------
``Verifier.handle(frame, emit)`` consumes one wire frame and calls ``emit(frame)`` for each
reply (sans-I/O: the same object serves the in-memory link of local mode and the relay loop of
``sfchat --tail``). The tail needs no model flags: a HELLO names the model, revision, split,
dtype and context size; the tail loads its slice through the loader it was given (reporting
PROGRESS), checks that what it loaded agrees with the hello, has the loader ready it for the
hello's frame shapes (its CUDA graphs on a GPU; shapes memory cannot hold are refused with an
ERROR), and answers READY (naming the dtype
it computes in: float16 instead of the head's bfloat16 on a GPU without bf16, such as a T4; the
head's hidden states are then converted on arrival).

Speculation trees, incrementally (the head's side is ``engine.live``): a tree is opened by the
frame whose first node has id 1 (after the prefill FORWARDs of the context the tail lacks, which
fill its KV cache: a tree's root position must be where they end). The tail keeps the tree's
**frontier**: the last node the target's walk committed (first the root, id 0: the context) and
the target's pick after it. A node of an arriving frame is live if its parent is the frontier
and its token that pick, or its parent is a live node of the same frame; every other node is
dead (its parent was dead, or the target picked another token after it) and is not computed. The
live nodes run at the frame's fixed shape (``Hello.shape``: padded, each row in a slot of a
``Scratch`` that lives for the frame, seeing the context, its ancestors and itself), the target
picks at each (a one-shape slice's frame refused when a node sits ``kv.SPAN`` or more positions
past the context: canonical attention reads a row's last ``SPAN`` positions as its own;
``sampling.picks``: one host sync, which also checks that the logits are finite;
a repetition penalty sees each row's own context: the committed tokens the tail holds, counted
on the device as they change (``sampling.Seen``), plus the row's ancestors in its frame and itself),
and the walk descends from the frontier while a pick is a child: those nodes are committed
(``Scratch.commit``: their K/V moves in place after the context, in every segment), and the
frontier moves to the last of them. Every frame gets a VERDICT (the committed nodes, empty when
none, and the picks). Frames of a tree older than the newest are dropped unread; node ids come
in order, one frame after another.

Every frame is hostile until checked: each HELLO field is checked for its exact JSON type and
range before anything is allocated or opened (``handshake.Hello.parse``); a FORWARD must agree
with the hello (hidden size, dtype, frame shapes, context). A frame that breaks the protocol gets
one ERROR reply and raises ``TailError``; so does any unexpected failure while handling a frame
(the tail then also forgets its context and asks the head to resync). The verifier itself stays
usable for the next frame and the next head.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from sfchat import UserError
from sfchat.protocol import wire
from sfchat.protocol.fields import shown
from sfchat.protocol.handshake import Hello, Ready
from sfchat.protocol.messages import Failure, Progress
from sfchat.engine import sampling
from sfchat.engine.scratch import Scratch
from sfchat.model import kv
from sfchat.model.decoder import n_layers
from sfchat.model.slices import ModelSlice
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
    def __init__(self, load, log=None):
        """``load(hello, progress)`` opens and loads the slice a hello names (a ``UserError`` when
        it cannot: refused as an ERROR); ``progress(stage, done, total, detail)`` reports to the
        head; ``load.shapes(model, hello, progress)`` readies the slice for the hello's frame shapes (its
        graphs), or raises a ``UserError`` saying why it cannot (refused as an ERROR). The loader
        (``node.tail_loader.TailLoader``) decides where models may come from, on which devices
        they run and what memory allows; the verifier only speaks the protocol."""
        self.load = load
        self.log = log or (lambda msg: None)
        self.model: ModelSlice | None = None
        self.hello: Hello | None = None  # the hello whose slice is loaded
        self.rounds = 0
        self.prefill_s = 0.0  # compute spent on prefill FORWARDs since the last verdict
        self.dropped = 0  # frames of older trees, dropped unread
        self.computed = self.skipped = 0  # nodes run, and nodes dead on arrival
        self.seen: sampling.Seen | None = None  # the context's tokens, for a repetition penalty
        self._trees()

    def _trees(self) -> None:
        self.tree = 0
        self.frontier: tuple[int, int, int] | None = None  # (node id, the pick after it, its position)
        self.root_pos = 0
        self.next_id = 1

    # -- frames --------------------------------------------------------------------------------
    def handle(self, frame: bytes, emit) -> None:
        try:
            self._handle(frame, emit)
        except TailError:
            raise
        except Exception as exc:  # a check this file lacks: still an answer, and the tail stays up
            self.log(f"{UNEXPECTED}: {type(exc).__name__}: {exc}")
            if self.model is not None:
                self.model.reset()
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
        try:  # a verify runs at one of the hello's frame shapes: the loader graphs them, or says why not
            self.load.shapes(self.model, hello, self._progress(emit))
        except UserError as exc:
            self._fail(emit, str(exc))
        self.model.reset(zero=True)  # nothing an earlier head left may reach this one's softmax
        self.seen = None
        self.prefill_s = 0.0
        self._trees()
        ready = Ready(n_layers=n_layers(cfg), hidden_size=cfg.hidden_size, device=str(self.model.device),
                      dtype=DTYPE_NAMES[self.model.dtype], load_s=round(time.perf_counter() - t0, 3), reused=reused)
        self.log(f"ready: {hello.model} layers [{hello.split}, {n_layers(cfg)}) on {self.model.device}")
        emit(ready.to_frame())

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
        sent = DTYPES[msg.dtype.name.lower()]
        if msg.hidden_size != m.config.hidden_size or DTYPE_NAMES[sent] not in (DTYPE_NAMES[m.dtype],
                                                                              self.hello.dtype):
            self._fail(emit, f"hidden states of size {msg.hidden_size}/{DTYPE_NAMES[sent]} do not match "
                             f"the tail's {m.config.hidden_size}/{DTYPE_NAMES[m.dtype]}")
        if msg.tree < self.tree:
            self.dropped += 1  # a tree the head has left
            return
        if msg.tree > self.tree:
            self.tree, self.frontier, self.next_id = msg.tree, None, 1
        if msg.verify:
            self._verify(msg, emit)
        else:
            self._prefill(msg, emit)

    def _prefill(self, msg: wire.Forward, emit) -> None:
        m, n = self.model, len(msg.tokens)
        if self.frontier is not None:
            self._fail(emit, f"a prefill FORWARD inside tree {msg.tree}, after its nodes")
        if msg.start_pos + n > m.max_len:
            self._fail(emit, f"positions up to {msg.start_pos + n} exceed the context of {m.max_len}")
        self._no_hole(msg.start_pos, emit)
        t0 = time.perf_counter()
        hidden = tensor_from_bytes(msg.hidden, DTYPES[msg.dtype.name.lower()], n, msg.hidden_size, m.device)
        m.feed(hidden.to(m.dtype), msg.start_pos, chunk=n)  # a one-shape slice: in pieces of its rows
        m.note(msg.start_pos, msg.tokens)
        self.prefill_s += time.perf_counter() - t0

    def _no_hole(self, start: int, emit) -> None:
        if start > self.model.held:
            self._fail(emit, f"context hole: the tail holds {self.model.held} positions, the head "
                             f"wrote at {start} (did the tail restart?)", resync=True)

    def _verify(self, msg: wire.Forward, emit) -> None:
        m, n = self.model, len(msg.tokens)
        shape = self.hello.shape(n)
        if shape is None:
            self._fail(emit, f"a tree frame of {n} nodes; the hello announced at most {self.hello.frames[-1]}")
        self._enter(msg, emit)
        self.next_id = msg.first_id + n
        live, above = self._live(msg)
        self.skipped += n - len(live)
        if not live:  # nothing of this frame can be on the committed path: nothing computed
            self._answer(msg, (), (), 0.0, emit)
            return
        # the live rows' slots, right after the context (everything up to the frontier), and the
        # trash slot of the padding rows: a scratch that lives for this frame (what is not committed
        # dies with it)
        scratch = Scratch(m, shape + 1)
        scratch.reset(self.frontier[2] + 1)
        if scratch.end > m.max_len:
            self._fail(emit, f"a tree frame reaching slot {scratch.end}, beyond the context of {m.max_len}")
        t0 = time.perf_counter()
        picks, positions = self._picks(msg, live, above, scratch, shape, emit)
        self.computed += len(live)
        path = self._walk(msg, live, picks)
        scratch.commit(path, [msg.tokens[live[r]] for r in path])
        last = path[-1]
        self.frontier = (msg.first_id + live[last], picks[last], positions[last])
        self._answer(msg, tuple(live[r] for r in path), tuple(picks[r] for r in path), time.perf_counter() - t0,
                     emit)

    def _enter(self, msg: wire.Forward, emit) -> None:
        """A frame opens its tree (node 1: the root, at the end of the context) or continues it."""
        if msg.first_id == 1:
            if self.frontier is not None:
                self._fail(emit, f"tree {msg.tree} opened twice")
            self._no_hole(msg.start_pos, emit)
            self.model.note(msg.start_pos, [])  # positions from the root on are the tree's
            self.frontier, self.root_pos = (0, msg.tokens[0], msg.start_pos - 1), msg.start_pos
        elif self.frontier is None or msg.first_id != self.next_id or msg.start_pos != self.root_pos:
            self._fail(emit, f"a frame of tree {msg.tree} with nodes from {msg.first_id} at root {msg.start_pos}: "
                             f"expected nodes from {self.next_id} at {self.root_pos} after an opening frame")

    def _live(self, msg: wire.Forward) -> tuple[list[int], list[int | None]]:
        """The frame indices of its live nodes, in order, and each one's parent's row among them
        (None: the frontier's child)."""
        frontier, pick, _ = self.frontier
        live: list[int] = []
        above: list[int | None] = []
        where: dict[int, int] = {}  # node id -> its row among the live ones
        for i, (parent, token) in enumerate(zip(msg.parents, msg.tokens)):
            if parent in where:
                up = where[parent]
            elif parent == frontier and token == pick and None not in above:
                up = None  # the target's pick after the frontier: the one node the walk may enter by
            else:
                continue
            where[msg.first_id + i] = len(live)
            live.append(i)
            above.append(up)
        return live, above

    def _picks(self, msg: wire.Forward, live: list[int], above: list[int | None], scratch: Scratch, shape: int,
               emit) -> tuple[list[int], list[int]]:
        """The live rows through the slice at the frame's shape (each row in its scratch slot, seeing
        the context and its ancestors): the target's pick at each, and each one's position."""
        m, rows, base = self.model, len(live), scratch.n
        ancestors: list[list[int]] = []
        for r in range(rows):
            ancestors.append([] if above[r] is None else ancestors[above[r]] + [above[r]])
        positions = [base + len(a) for a in ancestors]
        if m.canonical and max(positions) - base >= kv.SPAN:
            self._fail(emit, f"a tree frame with a node {max(positions) - base} positions past the context; "
                             f"at most {kv.SPAN - 1} may be")
        slots, mask = scratch.tree_inputs(list(zip(positions, range(rows), ancestors)), shape, m.device)
        sent = DTYPES[msg.dtype.name.lower()]
        hidden = tensor_from_bytes(msg.hidden, sent, len(msg.tokens), msg.hidden_size, m.device)[live].to(m.dtype)
        if rows < shape:
            hidden = torch.cat([hidden, hidden.new_zeros(shape - rows, msg.hidden_size)])
        logits = m.run(hidden, slots, n_logits=shape, end=scratch.reach, tree=mask)[:rows]
        seen = None
        if msg.sampling.repetition_penalty != 1.0:  # each row's context: the committed one and its path
            if self.seen is None or self.seen.vocab != logits.shape[-1]:
                self.seen = sampling.Seen(logits.shape[-1], logits.device)
            self.seen.sync(m.cached_tokens()[:base])
            seen = self.seen.rows([[msg.tokens[live[a]] for a in ancestors[r]] + [msg.tokens[live[r]]]
                                   for r in range(rows)])
        chosen = sampling.picks(logits, positions, msg.sampling, seen)
        out = torch.cat([chosen, torch.isfinite(logits).all().long()[None]]).tolist()  # the one host sync
        if not out[-1]:
            self._fail(emit, f"layers [{self.hello.split}, {self.hello.n_layers}) of {shown(self.hello.model)} "
                             f"computed logits that are not finite in {DTYPE_NAMES[m.dtype]} (an overflow: Qwen2.5 "
                             "in float16 is known to); start the head with --dtype bfloat16 on GPUs that have it, "
                             "or --dtype float32")
        return out[:-1], positions

    @staticmethod
    def _walk(msg: wire.Forward, live: list[int], picks: list[int]) -> list[int]:
        """The committed rows: from the frontier's live child down, while the pick is a child."""
        path, row = [], 0
        while row is not None:
            path.append(row)
            child = msg.first_id + live[row]
            row = next((r for r in range(row + 1, len(live))
                        if msg.parents[live[r]] == child and msg.tokens[live[r]] == picks[row]), None)
        return path

    def _answer(self, msg: wire.Forward, path, tokens, seconds: float, emit) -> None:
        # the frame's whole compute here, its prefill included: the head subtracts it from the round
        # trip, so that RTT is the network's alone
        tail_us = min(int((seconds + self.prefill_s) * 1e6), 2 ** 32 - 1)
        self.prefill_s = 0.0
        self.rounds += 1
        emit(wire.encode(wire.Verdict(msg.round, msg.tree, path, tokens, tail_us)))
