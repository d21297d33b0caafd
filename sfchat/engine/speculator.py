"""The head's speculation, sans I/O: the live tree of a reply, the frames that carry it, the verdicts.

Contract
--------
``Speculator(head, drafter, max_context, frame_size, steps, head_pool)`` holds the committed
context (token ids) of one conversation, the head slice, the draft and the reply's
``live.LiveTree``, and does every computation of a frame, but never touches a link: a ``Frame``
carries its encoded FORWARDs as ``bytes`` and a verdict comes back as a decoded ``wire.Verdict``.
The driver (``node.driver.RoundDriver``) moves them and owns every clock, failure and the number
of frames in flight.

* ``begin(prompt_ids)`` makes the prompt the context and opens a new tree: its first frame
  carries the context the target lacks as prefill FORWARDs before the tree FORWARD.
* ``frame(s, budget, min_yield, step_gain, max_steps)``: the next frame of at most ``frame_size``
  nodes, or None when nothing may be sent (the context window or the reply's budget reached, or,
  on a canonical head slice, every candidate ``kv.SPAN`` or more positions past the committed
  context) or
  the frame would be expected to commit fewer than ``min_yield`` tokens. The draft expands the
  tree's likeliest nodes up to ``steps`` times (a tree frame: fewer when ``max_steps`` says so,
  or once a step added less than ``step_gain`` tokens to the frame's expected yield; ``width``
  at a time, only nodes whose children could still enter this frame; a prompt-lookup
  continuation is grafted under the root at no draft cost), the tree chooses the frame's nodes
  best first, the head slice runs them at one fixed shape, padded to ``frame_size`` rows, or to
  the slice's one row count (``ModelSlice.rows``; each row sees the context, its ancestors in the
  head's scratch and itself), and the frame is encoded. The prefill runs through ``head.feed``
  (a one-shape slice's pieces at that row count too). Frames may be built while earlier ones are in flight: a frame's nodes hang anywhere
  in the live tree, under nodes of earlier frames whose verdicts are not known yet.
* ``grow(s, budget)``: one expansion step ahead of need, for the driver to run while a verdict
  travels (the likeliest nodes not yet expanded, anywhere in the live tree); False when there is
  nothing to expand or no room in the draft's pool. A frame built after it mostly takes nodes
  already proposed, and its own steps stop as soon as no expansion could change it.
* ``take(frame, verdict, eos, budget)``: the verdict, checked against the frame
  (``live.ProtocolError`` for anything it cannot be), committed and cut at the first EOS, the
  token budget and the context window (``Commit``). The committed nodes' K/V become context in
  place, in every segment, on the head slice and the draft (``Scratch.commit``: the scratch of
  each holds its nodes' slots); nodes no longer live give their slots back. A reply that ends (``finish``) closes the tree: the next ``begin`` opens another.
* ``forecast(ahead)``: the expected yield of a frame from the committed root within its steps'
  depth (the policy's forecast of one frame per round trip).
* ``restart()``: the tail lost its context (a new tail): the next frame sends all of it again.

Greedy output does not depend on any of it: every committed token is the target's own pick at a
node whose path is the committed context, and a sampled one the target's draw at that position
from a stream keyed by the reply's seed and the position alone, so the output is the same for any
draft, tree, frame size and number of frames in flight.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from sfchat import UserError
from sfchat.engine.lookup import lookup
from sfchat.engine.draft import Drafter
from sfchat.engine.frame import Commit, Frame
from sfchat.engine.live import Calibration, LiveTree, Node, ProtocolError
from sfchat.engine.scratch import Scratch
from sfchat.model.devices import DTYPE_NAMES
from sfchat.model import kv
from sfchat.model.kv import PREFILL_CHUNK
from sfchat.model.slices import ModelSlice
from sfchat.protocol import wire

LOOKUP_TOKENS = 8  # tokens of a prompt-lookup continuation grafted under the root


# a float's exponent bits: all set means inf or nan (the word's width, the mask)
_EXPONENT = {torch.float32: (np.uint32, 0x7F800000), torch.float16: (np.uint16, 0x7C00),
             torch.bfloat16: (np.uint16, 0x7F80)}


def hidden_bytes(h: torch.Tensor, what: str) -> bytes:
    """The hidden states as raw bytes; a UserError if any is not finite (fp16 overflow).

    The check reads the copied bits with numpy, on one thread: torch's own CPU op over a frame's
    rows runs on the intra-op thread pool, and on a GPU host whose cores other processes' pools
    spin on (the tail's, the compiler's workers) that took 38 ms a frame, measured on an H100
    host, against 0.1 here."""
    raw = h.contiguous().cpu().view(torch.uint8).numpy()
    word, mask = _EXPONENT[h.dtype]
    if bool(((raw.view(word) & mask) == mask).any()):
        raise UserError(what)
    return raw.tobytes()


class Speculator:
    def __init__(self, head: ModelSlice, drafter: Drafter | None, *, max_context: int,
                 frame_size: int, steps: int, head_pool: int):
        self.head, self.drafter = head, drafter
        self.max_context, self.steps = max_context, steps if drafter is not None else 0
        self.frame_size = frame_size  # nodes a frame may carry
        self.shape = head.rows or frame_size  # every frame runs at this one padded shape
        if self.shape < frame_size:
            raise ValueError(f"frames of {frame_size} nodes on a head slice whose forwards run at {head.rows} rows")
        self.scratch = Scratch(head, head_pool)  # the head slice's slots of the live nodes
        self.tokens: list[int] = []
        self.round_id = 0
        self.tree_id = 0
        self.live: LiveTree | None = None
        self.branching = drafter.children if drafter is not None else 1  # proposals kept per node (1: chain frames)
        self.calibration = Calibration(self.branching)
        self.device = head.device
        self.vocab = head.config.vocab_size
        self.wire_dtype = wire.DType[DTYPE_NAMES[head.dtype].upper()]
        self.unfed: list[Node] = []  # committed nodes the draft has not run, oldest first
        self.prefill_from: int | None = None  # where the next frame's prefill starts (None: sent)
        self.tree_start = 0

    # -- the conversation ----------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> int:
        """Make ``prompt_ids`` the context and open a tree; how many positions are already cached."""
        if len(prompt_ids) >= self.max_context:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens, the context window is "
                            f"{self.max_context}: shorten it or raise --max-context")
        if not prompt_ids:
            raise UserError("the prompt is empty")
        self.tokens = list(prompt_ids)
        reused = min(self.head.reusable(self.tokens), len(self.tokens) - 1)
        self._open()
        return reused

    def _open(self) -> None:
        """A new tree after the committed context: its root is the last committed token."""
        self.tree_id += 1
        self.live = LiveTree(self.tokens, self.calibration)
        self.prefill_from = min(self.head.reusable(self.tokens), len(self.tokens) - 1)
        self.tree_start = len(self.tokens) - 1
        self.scratch.reset(self.tree_start)
        self.unfed = []
        if self.drafter is not None:
            self.drafter.sync(self.tokens[:-1])

    def close(self) -> None:
        """End the tree (the reply ended, or its frames in flight are dropped): the next frame opens one."""
        self.live = None

    def reset(self) -> None:
        """Forget the conversation (a new chat): every cached position becomes stale."""
        self.tokens, self.live = [], None
        self.head.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def restart(self) -> None:
        """A new tail holds no context: the next frame sends it all again."""
        self.head.reset()
        self.live = None

    def forecast(self, ahead: int = 0) -> float | None:
        """The tokens one frame from the committed root would be expected to commit: the live
        tree's best ``frame_size`` nodes within the depth its ``steps`` (and ``ahead`` run while a
        verdict travels) reach; None before a tree is open, and while those nodes do not reach that
        depth (a tree grown less than such a frame would grow its own: at a short round trip
        stream's tree held 1.7 tokens' worth where a round frame committed 5; RESULTS, twelfth
        session)."""
        if self.live is None:
            return None
        depth = self.live.root.pos + min(self.steps + ahead, self.frame_size - 1)  # a frame's nodes reach so far
        value, deepest = self.live.expected(self.frame_size, depth + 1)
        return value if deepest >= depth else None

    # -- a frame -------------------------------------------------------------------------------
    def frame(self, s: wire.Sampling, budget: int, min_yield: float = 0.0, step_gain: float = 0.0,
              max_steps: int | None = None) -> Frame | None:
        """The next frame, or None when nothing may be sent (``budget``: tokens the reply may still
        commit) or it would be expected to commit fewer than ``min_yield`` tokens; a tree frame's
        own draft steps stop once one added less than ``step_gain`` to its expected yield (a chain
        frame always runs its K: ``--k`` is its length), and a tree frame's after ``max_steps`` when given."""
        if self.live is None:
            self._open()
        t0 = time.perf_counter()
        live = self.live
        # a node's pick is the token after it: only nodes whose picks fit the budget and the window
        room, max_pos = min(self.frame_size, self.scratch.free), self._max_pos(budget)
        steps = self._grow(s, room, max_pos, step_gain if self.branching > 1 else 0.0,
                           self.steps if max_steps is None or self.branching == 1 else min(max_steps, self.steps))
        t1 = time.perf_counter()
        nodes = live.choose(room, max_pos)
        expected = sum(live.value(n) for n in nodes)
        if not nodes or expected < min_yield:
            return None
        live.send(nodes)
        frames = self._prefill()
        frames.append(self._forward(nodes, s))
        t2 = time.perf_counter()
        self.round_id += 1
        return Frame(self.round_id, self.tree_id, nodes, frames, expected=expected, draft_ms=(t1 - t0) * 1e3, head_ms=(t2 - t1) * 1e3,
                     steady=len(frames) == 1, steps=steps)

    def _max_pos(self, budget: int) -> int:
        """Nodes at this position or later are never sent: their picks would pass the reply's
        ``budget`` or the context window, or (a canonical head slice) they would sit ``SPAN`` or
        more positions past the committed context."""
        deepest = self.scratch.n + kv.SPAN if self.head.canonical else self.max_context
        return min(self.max_context - 1, self.live.root.pos + budget, deepest)

    def grow(self, s: wire.Sampling, budget: int) -> bool:
        """One expansion step of the likeliest nodes not yet expanded (while a verdict travels);
        False when there is nothing to expand, or when it would leave the draft's pool less room
        than the next frame's own steps need."""
        if self.live is None or self.drafter is None:
            return False
        self._graft()
        d = self.drafter
        return self._step(s, self._max_pos(budget), -math.inf, reserve=self.steps * d.width + d.rows) is not None

    def _graft(self) -> None:
        """Under a root not sent yet, the prompt-lookup continuation (once, before the draft's)."""
        live = self.live
        if not live.root.sent and not live.root.children:
            branch = lookup(self.tokens, LOOKUP_TOKENS)
            if branch:
                live.graft(branch)

    def _grow(self, s: wire.Sampling, size: int, max_pos: int, step_gain: float, steps: int) -> int:
        """The draft's expansions for a frame of ``size`` nodes, after the committed nodes it has
        not run: at most ``steps``, only of nodes whose children could enter the frame (a child
        is never likelier than its parent, so a node no likelier than the frame's last candidate
        adds nothing to it; the bar is taken once, before the steps raise it), and no more once a
        step's new candidates that could enter the frame were worth less than ``step_gain`` tokens
        (the tree was mostly grown already: ahead of need, or under earlier frames). Returns the
        steps run."""
        self._graft()
        chosen = self.live.choose(size, max_pos)
        cut = chosen[-1].logv if chosen and len(chosen) >= size else -math.inf
        for step in range(steps):
            gain = self._step(s, max_pos, cut)
            if gain is None:
                return step
            if gain < step_gain:
                return step + 1
        return steps

    def _step(self, s: wire.Sampling, max_pos: int, cut: float, reserve: int = 0) -> float | None:
        """One draft step: the unfed committed nodes, then the likeliest expandable nodes above
        ``cut`` whose children fit before ``max_pos``, leaving ``reserve`` of the draft's slots
        free. Returns the summed values of the new candidates above ``cut`` (what the step may add
        to a frame; infinite for a step of catch-up alone), None when it had nothing to run."""
        live, d = self.live, self.drafter
        catch_up = self.unfed[:d.rows]
        room = min(d.width, d.rows - len(catch_up)) if len(catch_up) == len(self.unfed) else 0
        targets = [n for n in live.expandable(room) if n.logv > cut and n.pos + 1 < max_pos]
        need = sum(n not in d.scratch for n in catch_up + targets)
        free = d.scratch.free - reserve
        while targets and need > free:
            need -= targets.pop() not in d.scratch
        if not catch_up and not targets or need > free:
            return None
        rows = catch_up + targets
        out = d.expand([(n.token, n.pos, n, self._ancestors(n, catch_up)) for n in rows], s)
        if catch_up:  # their K/V is the context's now
            del self.unfed[:len(catch_up)]
            d.scratch.commit(catch_up, [n.token for n in catch_up])
        gain = 0.0 if targets else math.inf
        for node, proposals in zip(targets, out[len(catch_up):]):  # a token the target lacks can never be its pick
            live.expanded(node, [(tok, q) for tok, q in proposals if tok < self.vocab])
            gain += sum(live.value(c) for c in node.children.values() if c.logv > cut and not c.sent)
        return gain

    def _ancestors(self, node: Node, catch_up: list[Node]) -> list[Node]:
        """The nodes whose draft K/V ``node`` attends to in the draft's scratch: its live ancestors
        the draft ran, and the unfed committed nodes fed in the same step before it."""
        held = self.drafter.scratch
        ancestors = [a for a in node.path_to(None)[:-1] if a in held]
        if node in catch_up:
            return ancestors + catch_up[:catch_up.index(node)]
        return ancestors + catch_up

    def _release(self, node: Node) -> None:
        self.scratch.release(node)
        if self.drafter is not None:
            self.drafter.scratch.release(node)

    def _prefill(self) -> list[bytes]:
        """FORWARDs of the context the target lacks, before a tree's first frame."""
        if self.prefill_from is None:
            return []
        start, end = self.prefill_from, self.tree_start
        self.prefill_from = None
        if start >= end:
            self.head.note(end, [])
            return []
        ids = torch.tensor(self.tokens[start:end], dtype=torch.long, device=self.device).clamp_(max=self.vocab - 1)
        hidden = self.head.feed(ids, start)
        self.head.note(start, self.tokens[start:end])
        frames = [self._encode(i, self.tokens[i:min(i + PREFILL_CHUNK, end)],
                               hidden[i - start:min(i + PREFILL_CHUNK, end) - start], None, 0, wire.Sampling())
                  for i in range(start, end, PREFILL_CHUNK)]  # a FORWARD of at most PREFILL_CHUNK positions
        self.head.note(end, [])  # positions from the root on are stale (the tail drops them too)
        return frames

    def _forward(self, nodes: list[Node], s: wire.Sampling) -> bytes:
        """The head slice over the frame's nodes, padded to its shape; the tree FORWARD."""
        slots, mask = self.scratch.tree_inputs([(n.pos, n, n.path_to(None)[:-1]) for n in nodes], self.shape,
                                               self.device)
        ids = [min(n.token, self.vocab - 1) for n in nodes] + [0] * (self.shape - len(nodes))
        hidden = self.head.run(torch.tensor(ids, device=self.device), slots, end=self.scratch.reach,
                               tree=mask)[:len(nodes)]
        parents = tuple(self.live.parent_id(n) for n in nodes)
        return self._encode(self.tree_start, [n.token for n in nodes], hidden, parents, nodes[0].id, s)

    def _encode(self, start, tokens, hidden, parents, first_id, s) -> bytes:
        what = (f"the head's layers [{self.head.lo}, {self.head.hi}) of the target computed values that are not "
                f"finite in {DTYPE_NAMES[self.head.dtype]} (an overflow: Qwen2.5 in float16 is known to); use "
                "--dtype bfloat16 on a GPU that has it, or --dtype float32")
        return wire.encode(wire.Forward(
            round=self.round_id + 1, tree=self.tree_id, start_pos=start, tokens=tuple(tokens),
            hidden=hidden_bytes(hidden, what), dtype=self.wire_dtype, hidden_size=hidden.shape[-1],
            parents=parents, first_id=first_id, sampling=s))

    # -- a verdict -----------------------------------------------------------------------------
    def take(self, frame: Frame, verdict: wire.Verdict, eos_ids: set[int], budget: int) -> Commit:
        """Check ``verdict`` against ``frame`` and commit its tokens."""
        if verdict.round != frame.round_id or verdict.tree != frame.tree:
            raise ProtocolError(f"a verdict for frame {verdict.round} of tree {verdict.tree} answered frame "
                                f"{frame.round_id} of tree {frame.tree}")
        if self.live is None or frame.tree != self.tree_id:
            raise RuntimeError("a verdict taken for a closed tree")  # the driver's bug, never the tail's
        picks, dead = self.live.take(frame.nodes, verdict.path, verdict.tokens, self.vocab)
        committed = [frame.nodes[i] for i in verdict.path]
        for node in dead:  # their slots go back
            self._release(node)
        if committed:
            tokens = [n.token for n in committed]
            self.scratch.commit(committed, tokens)
            if self.drafter is not None:  # the draft's K/V of the nodes it ran, while none before is unfed
                held = self.drafter.scratch
                n_fed = 0 if self.unfed else next((i for i, n in enumerate(committed) if n not in held),
                                                  len(committed))
                held.commit(committed[:n_fed], tokens[:n_fed])
                self.unfed += committed[n_fed:]
        out, finish = [], None
        for t in picks:
            out.append(t)
            if t in eos_ids:
                finish = "eos"
            elif len(out) >= budget:
                finish = "length"
            elif len(self.tokens) + len(out) >= self.max_context:
                finish = "context"
            if finish:
                break
        self.tokens.extend(out)
        if finish:
            self.close()
        return Commit(tuple(out), finish)
