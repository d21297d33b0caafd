"""The head's speculative round, sans I/O: plan it, build its frames, take its verdict, commit.

Contract
--------
``HeadRound`` holds the committed context (token ids) of one conversation, the draft model and
the head slice, and does every computation of a round, but never touches a link: frames go out
as ``bytes`` in a ``Plan`` and the verdict comes back as a decoded ``wire.Verdict``. The driver
(``driver.RoundDriver``) moves them and owns every clock, failure and the number of frames in
flight. A round, top to bottom:

1. ``plan(s, shape)``: a round after the committed context, opening a new epoch. Where to write
   (``positions``: the first position whose cached K/V does not hold the committed token), the
   drafts of ``shape`` (a chain of ``shape.depth`` drafts, none at depth 0, or a token tree:
   ``Drafter.grow`` plus a prompt-lookup branch grafted at no draft cost, ``tree.lookup``), the
   head slice over every position the target has not cached yet plus ``[t0, drafts]`` (a tree's
   nodes with the tree mask); the context the tail lacks travels as prefill FORWARDs of
   ``PREFILL_CHUNK`` positions, the verify positions as the FORWARD that asks for a verdict.
2. ``speculate(plan, s, shape)``: the round that follows ``plan`` if its likeliest outcome
   happens: every draft on its likeliest path accepted (a chain's drafts; a tree's argmax chain,
   ``Tree.likeliest``) and the bonus the draft's own next token. Its frame names the same epoch
   and ``assumes`` that outcome, and the driver sends it before ``plan``'s verdict is known. A
   tree's assumed path has its K/V moved into place first, on the head and the draft.
3. ``take(plan, verdict, eos, budget)``: the verdict is checked against the plan (round id,
   position, accepted count at most the drafts sent, the accepted tokens equal to those drafts or
   a path down the tree, every id in the target's vocabulary; anything else is a
   ``ProtocolError``, never a token on screen), then committed and cut at the first EOS, at the
   token budget and at the context window. ``holds(plan, verdict)`` says whether the round
   speculated after ``plan`` assumed this verdict; if not, the driver drops the rounds in flight
   and plans anew: the tail drops their frames too (see ``tail``), and the cached K/V they wrote
   on the head and draft sits past the committed context, stale, until overwritten (``positions``
   compares the cache with the committed tokens; a tree's slots, saved before its assumed path
   moved, are put back and the real path moved instead).

A speculated round computes exactly what ``plan`` would compute after that verdict (same
positions, window, random stream and graph; the slots it reads were written before it), so the
output does not depend on how many frames were in flight. Random streams are per round and per
role (``sampling.round_generator``) and keyed by the context length, so a round sent early draws
exactly what the same round drafted after its verdict would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sfchat import UserError
from sfchat.protocol import wire
from sfchat.engine import sampling, tree as trees
from sfchat.engine.draft import Drafter, scratch_slots
from sfchat.model.kv import PREFILL_CHUNK
from sfchat.engine.policy import Shape
from sfchat.model.slices import ModelSlice
from sfchat.model.devices import DTYPE_NAMES


class ProtocolError(Exception):
    """The tail answered something that cannot be the verdict of the round that was sent."""


@dataclass
class Plan:
    """One round, ready to send: its frames and what the verdict will be checked against."""

    round_id: int
    epoch: int
    verify_start: int  # position of t0, the last token of ``basis``, in the verify FORWARD
    basis: list[int]  # the context it was drafted after: the committed one, or one it assumes
    drafts: list[int]
    frames: list[bytes]
    draft_ms: float
    head_ms: float
    shape: Shape
    tree: trees.Tree | None = None  # a tree round: the tree whose nodes are ``drafts``
    assumes: tuple[int, ...] = ()  # the verdict tokens of the round before it that it assumes
    outcome: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (path, tokens) a round after it assumes
    saved: tuple | None = None  # a tree's K/V slots as they were before its assumed path moved
    sent_at: float = 0.0  # perf_counter when its frames went out
    steady: bool = True  # no prefill and no catch-up feed of the draft: its compute is a round's alone
    forward_bytes: int = field(init=False)
    sent_bytes: int = field(init=False)
    depth: int = field(init=False)  # how deep the drafts reach: K for a chain, the deepest node of a tree

    def __post_init__(self) -> None:
        self.forward_bytes = len(self.frames[-1])
        self.sent_bytes = sum(map(len, self.frames))
        self.depth = max(self.tree.depths) if self.tree is not None else len(self.drafts)

    @property
    def context_len(self) -> int:
        return len(self.basis)

    def likeliest(self) -> list[int]:
        """The accepted path this round most likely gets (node indices; 1..K for a chain)."""
        return self.tree.likeliest() if self.tree is not None else list(range(1, len(self.drafts) + 1))


@dataclass(frozen=True)
class Commit:
    tokens: tuple[int, ...]  # committed this round (after truncation)
    accepted: int
    finish: str | None  # None, "eos", "length" or "context"


def hidden_bytes(h: torch.Tensor) -> bytes:
    return h.contiguous().view(torch.uint8).cpu().numpy().tobytes()


class HeadRound:
    def __init__(self, head: ModelSlice, drafter: Drafter | None, *, max_context: int,
                 shapes: list[Shape] | None = None):
        """``shapes``: those rounds may take (default: the drafter's own chain or tree)."""
        self.head, self.drafter = head, drafter
        self.k = drafter.k if drafter is not None else 0
        self.shapes = shapes or [Shape(self.k, drafter.budget if drafter is not None else 0)]
        self.max_context = max_context
        self.tokens: list[int] = []
        self.round_id = 0
        self.epoch = 0
        self.device = head.device
        self.vocab = head.config.vocab_size
        self.wire_dtype = wire.DType[DTYPE_NAMES[head.dtype].upper()]

    # -- the conversation ----------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> int:
        """Make ``prompt_ids`` the context; returns how many of its positions are already cached."""
        if len(prompt_ids) >= self.max_context:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens, the context window is "
                            f"{self.max_context}: shorten it or raise --max-context")
        if not prompt_ids:
            raise UserError("the prompt is empty")
        self.tokens = list(prompt_ids)
        return self.positions(self.tokens)

    def reset(self) -> None:
        """Forget the conversation (a new chat): every cached position becomes stale."""
        self.tokens = []
        self.head.kv.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def forget_tail(self) -> None:
        """A new tail holds no context: writing from position 0 re-primes it with the committed
        tokens (never changed by a fault) through the ordinary prefill path."""
        self.head.kv.reset()

    def positions(self, tokens: list[int]) -> int:
        """The write position of a round over ``tokens``: the first position whose K/V the target
        does not hold, at most the last token's (t0 is always re-run: its output is the first
        verified position)."""
        return min(self.head.kv.reusable(tokens), len(tokens) - 1)

    # -- 1. plan ---------------------------------------------------------------------------------
    def plan(self, s: wire.Sampling, shape: Shape | None = None) -> Plan:
        """A round after the committed context: the first of a new epoch."""
        self.epoch += 1
        return self._plan(self.tokens, s, shape or self.shapes[0], ())

    def _plan(self, tokens: list[int], s: wire.Sampling, shape: Shape, assumes: tuple[int, ...]) -> Plan:
        t0 = time.perf_counter()
        n = len(tokens)
        start = self.positions(tokens)
        drafts, q_idx, q_prob, tree = [], None, None, None
        fed = 0
        if shape.budget:
            tree = self.drafter.grow(tokens, s)
            branch = trees.lookup(tokens, self.k)
            if branch:
                tree = trees.graft(tree, branch)
            drafts = list(tree.tokens)
            fed = self.drafter.fed
        elif shape.depth:
            gen = sampling.round_generator(s.seed, n, "draft", self.drafter.device) if s.temperature > 0 else None
            drafts, q_idx, q_prob = self.drafter.propose(tokens, s, gen, shape.depth)
            fed = self.drafter.fed
        t1 = time.perf_counter()
        self.round_id += 1
        v = n - 1  # t0's position (a tree's root)
        frames = self._prefill(tokens, start, s)
        if assumes and frames:  # the frame that assumes a verdict must start where it leaves the context
            raise RuntimeError(f"a speculated round over {n} tokens would re-send positions {start}..{v}")
        frames.append(self._forward([tokens[-1]] + drafts, v, len(drafts), True, s, q_idx, q_prob, tree, assumes))
        t2 = time.perf_counter()
        return Plan(self.round_id, self.epoch, v, list(tokens), drafts, frames,
                    draft_ms=(t1 - t0) * 1e3, head_ms=(t2 - t1) * 1e3, shape=shape, tree=tree, assumes=assumes,
                    steady=len(frames) == 1 and fed <= 2)

    def _prefill(self, tokens: list[int], start: int, s: wire.Sampling) -> list[bytes]:
        """FORWARDs of the context the target has not seen yet: positions ``start`` up to t0's."""
        end = len(tokens) - 1
        return [self._forward(tokens[i:min(i + PREFILL_CHUNK, end)], i, 0, False, s, None, None)
                for i in range(start, end, PREFILL_CHUNK)]

    def _forward(self, piece, start, n_draft, want_verdict, s, q_idx, q_prob, tree=None, assumes=()) -> bytes:
        # A draft from a larger draft vocabulary has no embedding row here; any row will do: the
        # tail rejects such a draft (p = 0), so nothing computed from this position is committed.
        ids = torch.tensor(piece, dtype=torch.long, device=self.device).clamp_(max=self.vocab - 1)
        positions = torch.arange(start, start + len(piece), device=self.device)
        mask = trees.mask(tree.parents, start, self.device) if tree is not None else None
        hidden = self.head.run(ids, positions, end=start + len(piece), tree=mask)
        self.head.kv.note(start, piece[:1] if tree is not None else piece)  # a tree's nodes: scratch
        n_q = q_idx.shape[1] if q_idx is not None and n_draft else 0
        return wire.encode(wire.Forward(
            round=self.round_id, start_pos=start, tokens=tuple(piece), hidden=hidden_bytes(hidden),
            dtype=self.wire_dtype, hidden_size=hidden.shape[-1], n_draft=n_draft,
            want_verdict=want_verdict, sampling=s, n_q=n_q,
            q_indices=q_idx.to(torch.int32).cpu().numpy().tobytes() if n_q else b"",
            q_probs=q_prob.to(torch.float32).cpu().numpy().tobytes() if n_q else b"",
            parents=tuple(tree.parents) if tree is not None else None, epoch=self.epoch, assumes=assumes,
        ))

    # -- 2. speculate: the next round, before this one's verdict ---------------------------------
    def can_speculate(self, plan: Plan, budget: int, eos_ids: set[int]) -> bool:
        """Whether a round may follow ``plan``'s likeliest outcome: a draft to guess the bonus,
        room in the token budget and the context window, and no EOS among the assumed drafts."""
        if self.drafter is None:
            return False
        path = plan.likeliest()
        ahead = plan.context_len + len(path) + 1  # the context if that outcome is committed
        drafted = plan.tree.path_tokens(path) if plan.tree is not None else plan.drafts
        return (ahead - len(self.tokens) < budget and ahead + self.k + 1 <= self.max_context
                and not eos_ids.intersection(drafted))

    def speculate(self, plan: Plan, s: wire.Sampling, shape: Shape | None = None) -> Plan:
        """The round after ``plan``'s likeliest outcome (call ``can_speculate`` first)."""
        path = plan.likeliest()
        if plan.tree is not None:  # that path's K/V moves into place, as ``take`` would move it
            accepted = plan.tree.path_tokens(path)
            first = plan.verify_start + 1  # the tree's slots, and the draft's frontier, start here
            plan.saved = (self.head.save(first, len(plan.tree)),
                          self.drafter.model.save(first, scratch_slots(self.k, self.drafter.budget, self.drafter.vocab)))
            self.head.keep([plan.verify_start + i for i in path], first, accepted)
            self.drafter.keep(plan.tree, path, plan.context_len)
        else:
            accepted = plan.drafts
        assumed = plan.basis + accepted
        guess = self.drafter.next_token(assumed)
        plan.outcome = (tuple(path), tuple(accepted) + (guess,))
        return self._plan(assumed + [guess], s, shape or plan.shape, plan.outcome[1])

    def holds(self, plan: Plan, verdict: wire.Verdict) -> bool:
        """Whether ``verdict`` (of ``plan``) is the outcome the round speculated after it assumed."""
        return plan.outcome is not None and tuple(verdict.tokens) == plan.outcome[1]

    # -- 3. take the verdict -----------------------------------------------------------------------
    def take(self, plan: Plan, verdict: wire.Verdict, eos_ids: set[int], budget: int) -> Commit:
        """Check ``verdict`` against ``plan`` and commit its tokens (ProtocolError if it cannot
        be this round's verdict)."""
        check_verdict(plan, verdict, self.vocab)
        if len(self.tokens) != plan.context_len or self.tokens != plan.basis:
            raise RuntimeError("a verdict taken out of order")  # the driver's bug, never the tail's
        path = list(verdict.path)
        if plan.tree is not None and (plan.outcome is None or tuple(path) != plan.outcome[0]):
            if plan.saved is not None:  # the assumed path was moved, and rounds in flight wrote after it
                self.head.restore(plan.saved[0])
                self.drafter.model.restore(plan.saved[1])
            # the accepted nodes' K/V move into place
            accepted = plan.tree.path_tokens(path)
            self.head.keep([plan.verify_start + i for i in path], plan.verify_start + 1, accepted)
            self.drafter.keep(plan.tree, path, plan.context_len)
        plan.saved = None
        committed, finish = [], None
        for t in verdict.tokens:
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
        return Commit(tuple(committed), verdict.n_accepted, finish)


def check_verdict(plan: Plan, v: wire.Verdict, vocab: int) -> None:
    """A verdict the head can commit: this round's, no more accepted than drafted, the accepted
    tokens exactly the drafts (of a tree: a path down from its root, each node a child of the one
    before), one token past them, every id in the vocabulary."""
    if v.round != plan.round_id or v.start_pos != plan.verify_start:
        raise ProtocolError(f"a verdict for round {v.round} at position {v.start_pos} answered round "
                            f"{plan.round_id} at {plan.verify_start}")
    k = plan.depth
    if not 0 <= v.n_accepted <= k or len(v.tokens) != v.n_accepted + 1 or len(v.path) != v.n_accepted:
        raise ProtocolError(f"a verdict accepting {v.n_accepted} of {k} drafts with {len(v.tokens)} tokens")
    if plan.tree is None:
        if list(v.path) != list(range(1, v.n_accepted + 1)):
            raise ProtocolError("a chain's verdict whose path skips drafts")
        if list(v.tokens[:v.n_accepted]) != plan.drafts[:v.n_accepted]:
            raise ProtocolError("a verdict whose accepted tokens are not the drafts that were sent")
    else:
        parents, above = plan.tree.parents, 0
        for node in v.path:
            if not 1 <= node <= len(parents) or parents[node - 1] != above:
                raise ProtocolError(f"a verdict path through node {node}, which does not descend the tree sent")
            above = node
        if list(v.tokens[:v.n_accepted]) != plan.tree.path_tokens(v.path):
            raise ProtocolError("a verdict whose accepted tokens are not the tree's nodes on its path")
    bad = [t for t in v.tokens if not 0 <= t < vocab]
    if bad:
        raise ProtocolError(f"a verdict with token id {bad[0]} outside the vocabulary of {vocab}")
