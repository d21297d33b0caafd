"""The head's speculative round, sans I/O: plan it, build its frames, take its verdict, commit.

Contract
--------
``HeadRound`` holds the committed context (token ids) of one conversation, the draft model and
the head slice, and does every computation of a round, but never touches a link: frames go out
as ``bytes`` in a ``Plan`` and the verdict comes back as a decoded ``wire.Verdict``. The driver
(``driver.RoundDriver``) moves them and owns every clock and failure. A round, top to bottom:

1. ``plan(s)``: where to write (``positions``: the first position whose cached K/V does not
   hold the committed token, computed once here and handed to the drafter, the head slice and
   the frame), K drafts after the context, the head slice over every position the target has not
   cached yet (the prompt on a first round, less what an earlier turn left) plus ``[t0, d1..dK]``;
   the context the tail lacks travels as prefill FORWARDs of ``PREFILL_CHUNK`` positions, the
   last K+1 positions as the FORWARD that asks for a verdict.
2. ``take(plan, verdict, eos, budget)``: the verdict is checked against the plan (round id,
   position, accepted count at most the drafts sent, the accepted tokens equal to those drafts,
   every id in the target's vocabulary; anything else is a ``ProtocolError``, never a token on
   screen), then committed and cut at the first EOS, at the token budget and at the context window.
3. ``prepare(plan, s, budget)``: optional, done while the verdict travels. It plans the next round
   for the outcome "every draft accepted, and the bonus is the draft's own next token": the draft
   proposes after ``context + drafts + [guess]`` and the head slice runs on it. ``prepared_for``
   tells whether a committed outcome is that one; then the prepared plan is the next round and its
   frame goes out without drafting. A prepared plan computes exactly what ``plan`` would compute
   after that verdict (same positions, window, random stream and graph; the slots it reads were
   written before it), so output is identical whether or not a round was prepared or hit; on a miss
   the next ``plan`` overwrites the slots the preparation wrote.

With a tree budget (``Drafter(tree_budget=N)``) step 1 grows a token tree instead of a chain
(``Drafter.grow``, plus a prompt-lookup branch grafted at no draft cost: ``tree.lookup``) and the
verify FORWARD is ``[t0, node 1..N]`` with the nodes' parents, run through the head slice with the
tree mask; ``take`` checks that the verdict's path descends the tree that was sent and moves the
accepted nodes' K/V into place on the head slice and the draft (``keep``). Trees are not prepared
ahead (``can_prepare`` is False).

Random streams are per round and per role (``sampling.round_generator``) and keyed by the context
length, so a prepared round draws exactly what the same round drafted after the verdict would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sfchat import UserError, wire
from sfchat.runtime import sampling, tree as trees
from sfchat.runtime.draft import Drafter
from sfchat.runtime.kv import PREFILL_CHUNK
from sfchat.runtime.slices import DTYPE_NAMES, ModelSlice


class ProtocolError(Exception):
    """The tail answered something that cannot be the verdict of the round that was sent."""


@dataclass
class Plan:
    """One round, ready to send: its frames and what the verdict will be checked against."""

    round_id: int
    verify_start: int  # position of t0, the last committed token, in the verify FORWARD
    context_len: int  # committed tokens when the round was planned
    drafts: list[int]
    frames: list[bytes]
    draft_ms: float
    head_ms: float
    guess: int | None = None  # a prepared plan: the bonus token it assumes
    tree: trees.Tree | None = None  # a tree round: the tree whose nodes are ``drafts``
    forward_bytes: int = field(init=False)

    depth: int = field(init=False)  # how deep the drafts reach: K for a chain, the deepest node of a tree

    def __post_init__(self) -> None:
        self.forward_bytes = len(self.frames[-1])
        self.depth = max(self.tree.depths) if self.tree is not None else len(self.drafts)


@dataclass(frozen=True)
class Commit:
    tokens: tuple[int, ...]  # committed this round (after truncation)
    accepted: int
    finish: str | None  # None, "eos", "length" or "context"


def hidden_bytes(h: torch.Tensor) -> bytes:
    return h.contiguous().view(torch.uint8).cpu().numpy().tobytes()


class HeadRound:
    def __init__(self, head: ModelSlice, drafter: Drafter | None, *, max_context: int):
        self.head, self.drafter = head, drafter
        self.k = drafter.k if drafter is not None else 0
        self.max_context = max_context
        self.tokens: list[int] = []
        self.round_id = 0
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
    def plan(self, s: wire.Sampling) -> Plan:
        return self._plan(self.tokens, s)

    def _plan(self, tokens: list[int], s: wire.Sampling, guess: int | None = None) -> Plan:
        if self.drafter is not None and self.drafter.budget:
            return self._plan_tree(tokens, s)
        t0 = time.perf_counter()
        n = len(tokens)
        start = self.positions(tokens)
        drafts, q_idx, q_prob = [], None, None
        if self.drafter is not None:
            gen = sampling.round_generator(s.seed, n, "draft", self.drafter.device) if s.temperature > 0 else None
            drafts, q_idx, q_prob = self.drafter.propose(tokens, s, gen)
        t1 = time.perf_counter()
        self.round_id += 1
        frames = self._prefill(tokens, start, s)
        frames.append(self._forward(tokens[-1:] + drafts, n - 1, len(drafts), True, s, q_idx, q_prob))
        t2 = time.perf_counter()
        return Plan(self.round_id, n - 1, n, drafts, frames,
                    draft_ms=(t1 - t0) * 1e3, head_ms=(t2 - t1) * 1e3, guess=guess)

    def _plan_tree(self, tokens: list[int], s: wire.Sampling) -> Plan:
        t0 = time.perf_counter()
        n = len(tokens)
        start = self.positions(tokens)
        tree = self.drafter.grow(tokens, s)
        branch = trees.lookup(tokens, self.k)
        if branch:
            tree = trees.graft(tree, branch)
        t1 = time.perf_counter()
        self.round_id += 1
        v = n - 1  # t0's position: the tree's root
        frames = self._prefill(tokens, start, s)
        frames.append(self._forward([tokens[-1]] + tree.tokens, v, len(tree), True, s, None, None, tree))
        t2 = time.perf_counter()
        return Plan(self.round_id, v, n, list(tree.tokens), frames,
                    draft_ms=(t1 - t0) * 1e3, head_ms=(t2 - t1) * 1e3, tree=tree)

    def _prefill(self, tokens: list[int], start: int, s: wire.Sampling) -> list[bytes]:
        """FORWARDs of the context the target has not seen yet: positions ``start`` up to t0's."""
        end = len(tokens) - 1
        return [self._forward(tokens[i:min(i + PREFILL_CHUNK, end)], i, 0, False, s, None, None)
                for i in range(start, end, PREFILL_CHUNK)]

    def _forward(self, piece, start, n_draft, want_verdict, s, q_idx, q_prob, tree=None) -> bytes:
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
            parents=tuple(tree.parents) if tree is not None else None,
        ))

    # -- 2. take the verdict -----------------------------------------------------------------------
    def take(self, plan: Plan, verdict: wire.Verdict, eos_ids: set[int], budget: int) -> Commit:
        """Check ``verdict`` against ``plan`` and commit its tokens (ProtocolError if it cannot
        be this round's verdict)."""
        check_verdict(plan, verdict, self.vocab)
        if plan.tree is not None:  # the accepted nodes' K/V move from scratch to their positions
            path = list(verdict.path)
            accepted = plan.tree.path_tokens(path)
            self.head.keep([plan.verify_start + i for i in path], plan.verify_start + 1, accepted)
            self.drafter.keep(plan.tree, path, plan.context_len)
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

    # -- 3. prepare the next round under the wait ------------------------------------------------
    def can_prepare(self, plan: Plan, budget: int) -> bool:
        """Whether the all-accepted outcome of ``plan`` could be followed by another full round."""
        k = len(plan.drafts)
        after = plan.context_len + k + 1  # the context if every draft and the bonus are committed
        return (self.drafter is not None and plan.tree is None and k > 0 and budget > k + 1
                and after + self.k + 1 <= self.max_context)

    def prepare(self, plan: Plan, s: wire.Sampling) -> Plan:
        """The round that follows ``plan`` if every draft is accepted and the bonus is the draft's
        own next token (call ``can_prepare`` first)."""
        assumed = self.tokens[:plan.context_len] + plan.drafts
        guess = self.drafter.next_token(assumed)
        return self._plan(assumed + [guess], s, guess)

    def prepared_for(self, prepared: Plan | None, plan: Plan, commit: Commit) -> Plan | None:
        """``prepared`` if ``commit`` (of ``plan``) is the outcome it assumed, else None."""
        if prepared is None or commit.finish is not None:
            return None
        return prepared if list(commit.tokens) == plan.drafts + [prepared.guess] else None


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
