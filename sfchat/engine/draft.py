"""The draft model: proposes K tokens per round from the committed context.

Contract
--------
``Drafter.propose(tokens, sampling, generator, k)`` takes the whole committed context (token ids)
and returns ``k`` (at most K; one of ``depths`` to be graphed) proposed continuations plus the sparse proposal distributions they were drawn
from (empty when greedy). It keeps its own static KV cache in step with the context by
itself: whatever prefix of ``tokens`` is already cached is reused (multi-turn, rejected
drafts), the rest is fed first. In the steady state the feed is exactly the last two committed
tokens (re-writing one already-cached position): this covers both "some drafts rejected"
(one new token) and "all K accepted" (d_K was never fed to the draft, plus the bonus), and it
gives every round the same shapes, which is what lets the round be captured in a CUDA graph
(one per depth and attention window, see ``kv.StaticKV.windows``; a compiled draft has one graph
per depth, over all slots, so that it is compiled once). ``next_token(tokens)`` is the draft's
greedy guess of one token (graphed too): the bonus a round in flight assumes.

Graphs and the CPU run the same code: each round is a plain function of tensors (``_chain``,
``_tree``, ``_guess``) that ``model.graphs.GraphTable`` either replays from a graph captured over
it or calls. Sampled rounds are graphed too: the sampling settings (``sampling.Knobs``) and the
round's random numbers (Exp(1) noise drawn from the round's generator) are graph inputs.

``Drafter(model, k, tree_budget=N)`` grows a token tree instead (``grow``): up to ``k`` deep,
``N`` nodes, best-first by the path's cumulative draft log-probability (of the warped
distribution when sampling). After the same two-token feed, each depth is one batched forward
of the ``width`` likeliest frontier nodes, written in scratch slots after the context with the
tree mask (each sees the context and its own ancestors); each keeps its ``children`` likeliest
continuations as candidates, and the N best candidates of all depths are the tree (a path's
score never rises, so the best N include every chosen node's ancestors). The draft's own
argmax chain, k deep, is always part of the tree (ranked first at every depth), so a tree
accepts at least what the chain of the same depth would: the rest of the budget goes
best-first. No host sync until the tree is read, so the grow is one CUDA graph per window too. ``keep(tree, path, n)``
moves the K/V of the accepted nodes the draft has fed into place after the verdict, so the
next round's feed is again the last two committed tokens.

The drafter knows nothing about the target, the wire or acceptance.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from sfchat.engine import sampling
from sfchat.model.kv import PREFILL_CHUNK, TreeMask
from sfchat.engine.tree import Tree
from sfchat.model.graphs import GraphTable
from sfchat.model.slices import ModelSlice
from sfchat.protocol.wire import Sampling

TREE_WIDTH = 8  # frontier nodes expanded per depth
CHAIN_FIRST = 1e4  # added to the rank of the argmax chain's nodes (scores are clamped at -1000)


def tree_shape(budget: int, depth: int, vocab: int) -> tuple[int, int, int]:
    """(width, children per expanded node, nodes) of a tree of ``budget`` nodes ``depth`` deep:
    enough candidates for the budget when the vocabulary allows (else fewer nodes)."""
    width = max(1, min(TREE_WIDTH, budget))
    children = min(vocab, max(width, math.ceil(budget / (1 + (depth - 1) * width))))
    width = min(width, children)
    return width, children, min(budget, children + (depth - 1) * width * children)


def scratch_slots(k: int, tree_budget: int, vocab: int) -> int:
    """Slots past the context a round may write: K+1 for a chain; for a tree, its frame
    (t0 and the nodes) and the draft's frontier forwards."""
    if not tree_budget:
        return k + 1
    width, _, nodes = tree_shape(tree_budget, k, vocab)
    return max(nodes + 1, (k - 1) * width + 1)


class Drafter:
    def __init__(self, model: ModelSlice, k: int, n_q: int = 32, tree_budget: int = 0,
                 depths: tuple[int, ...] = ()):
        self.model, self.k, self.n_q = model, k, n_q
        self.depths = tuple(d for d in (depths or (k,)) if d > 0)  # chain depths rounds may ask for
        self.device = model.device
        self.vocab = model.config.vocab_size
        self.forward = model.forward  # compiled by ``capture(compile=True)``
        self.graphs = GraphTable()  # keys: ("chain", depth, sampled), ("tree", sampled), ("guess",)
        self.fed = 0  # context tokens the last propose or grow fed (2 in the steady state)
        self.width, self.children, self.budget = tree_shape(tree_budget, k, self.vocab) if tree_budget else (0, 0, 0)

    # -- graphs --------------------------------------------------------------------------------
    def capture(self, log=None, compile: bool = False) -> bool:
        """Capture the steady-state round (the 2-token feed and the drafting steps: for each
        depth, greedy and sampled; the tree with a tree budget; the one-token guess) as one CUDA
        graph per attention window (one graph over all slots when compiled: each window would be
        compiled anew, and a compiled round over all slots still beats an uncompiled one over few).
        A sampled graph takes the sampling settings (``sampling.Knobs``) and the round's random
        numbers as inputs, so one graph serves every setting.

        With ``compile``, the draft's forward is first compiled by torch.compile (Inductor fuses
        the many small elementwise kernels of a small model's decode step); the compiled code
        then runs inside the hand-captured graph. Compiled numerics differ slightly from eager,
        which is harmless here: a draft token is only a proposal, the target decides."""
        if compile:
            self.forward = torch.compile(self.model.forward, dynamic=False)
        ids = torch.zeros(2, dtype=torch.long, device=self.device)
        start = torch.zeros(1, dtype=torch.long, device=self.device)
        knobs = sampling.Knobs.of(Sampling(temperature=1.0), self.device).tensors()
        kv = self.model.kv
        every = [kv.max_len] if compile else None
        if self.budget:
            scratch = (self.k - 1) * self.width
            for sampled in (False, True):
                self.graphs.capture(("tree", sampled), f"draft's {self.budget}-node tree", self._tree,
                                    (ids, start) + (knobs if sampled else ()),
                                    every or [w for w in kv.windows if w > scratch + 2], log)
        for k in self.depths:
            noise = torch.ones(k, self.n_q, device=self.device)
            for sampled in (False, True):
                self.graphs.capture(("chain", k, sampled), f"draft's {k}-step {'sampled ' if sampled else ''}round",
                                    partial(self._chain, k=k), (ids, start) + ((noise,) + knobs if sampled else ()),
                                    every or [w for w in kv.windows if w > k], log)
        # the guess of a bonus token for a round in flight (``next_token``): one step, not compiled
        # (a compiled forward would compile again for the one-token shape)
        self.graphs.capture(("guess",), "draft's one-token step", self._guess, (ids[:1], start), list(kv.windows), log)
        return bool(self.graphs)

    # -- the plain functions that graphs capture and the CPU runs ------------------------------
    def _chain(self, ids, start, *args, k: int):
        """Feed ``ids`` at ``start...`` then draft ``k`` tokens; ``args``: ``(noise (k, n_q),
        temperature, top_k, drop_p, window)`` when sampling, ``(window,)`` greedy."""
        *tensors, window = args
        logits = self.forward(ids, start + torch.arange(ids.shape[0], device=ids.device), n_logits=1, window=window)
        next_pos = start + ids.shape[0]
        noise, knobs = (tensors[0], sampling.Knobs(*tensors[1:])) if tensors else (None, None)
        n_q = noise.shape[1] if tensors else 0
        picks, q_idx, q_prob = [], [], []
        for i in range(k):
            tok, qi, qp = sampling.choose(logits, knobs, n_q, noise[i:i + 1] if noise is not None else None)
            picks.append(tok)
            q_idx.append(qi)
            q_prob.append(qp)
            if i + 1 < k:
                logits = self.forward(tok, next_pos + i, n_logits=1, window=window)
        return torch.cat(picks), torch.cat(q_idx), torch.cat(q_prob)

    def _tree(self, ids, start, *args):
        """Feed ``ids`` at ``start...`` then grow the tree (``(temperature, top_k, drop_p, window)``
        when sampling, ``(window,)`` greedy)."""
        *tensors, window = args
        logits = self.forward(ids, start + torch.arange(ids.shape[0], device=ids.device), n_logits=1, window=window)
        return self._grow_steps(logits, start + ids.shape[0], sampling.Knobs(*tensors) if tensors else None, window)

    def _guess(self, ids, start, window):
        return self.forward(ids, start + torch.arange(ids.shape[0], device=ids.device), 1, window).argmax(-1)

    def _run(self, key, fn, tokens: list[int], start: int, extra: tuple, window: int):
        """``fn`` over ``tokens`` fed at ``start`` (the table's graph in the steady state) after any
        catch-up, so that the round itself always has the steady shape when it can."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).clamp_(max=self.vocab - 1)
        out = self.graphs.run(key + (len(tokens),) if len(tokens) != 2 else key, fn,
                              (ids, torch.tensor([start], device=self.device)) + extra, window)
        self.model.kv.note(start, tokens)
        return out

    def _catch_up(self, tokens: list[int], window: int, keep: int = 2) -> int:
        """Feed what the cache lacks of ``tokens`` but the last ``keep`` (re-fed by the round
        itself, so that its shape is the graphed one); returns where the round's feed starts."""
        n = len(tokens)
        start = min(self.model.kv.reusable(tokens), n - 1, max(n - keep, 0))
        self.fed = n - start
        if n - start > keep:
            self._feed(tokens[start:n - keep], start, window)
            start = n - keep
        return start

    @staticmethod
    def _logp(logits: torch.Tensor, knobs: "sampling.Knobs | None") -> torch.Tensor:
        return logits.float().log_softmax(-1) if knobs is None else sampling.warp(logits, knobs).log()

    def _grow_steps(self, logits, n: torch.Tensor, knobs: "sampling.Knobs | None", window: int):
        """The tree after the context of length ``n`` (1,), from the draft's logits at t0 (1, V);
        no host sync. Returns (tokens, parents, fed slots, ranks) of the chosen nodes, (N,) each:
        a rank is the path's score, the argmax chain's raised above all others (``graft`` keeps it)."""
        W, C, depth = self.width, self.children, self.k
        dev = logits.device
        score, tok = self._logp(logits, knobs).topk(C, dim=-1)
        toks, scores = [tok[0]], [score[0]]
        parents = [torch.full((C,), -1, dtype=torch.long, device=dev)]
        depths = [torch.ones(C, device=dev)]
        rank0 = torch.arange(C, device=dev) == 0
        greedy = [rank0]  # the draft's argmax chain: each node the first choice of the one before
        size = C + (depth - 1) * W * C
        fed = torch.full((size,), -1, dtype=torch.long, device=dev)
        front = torch.arange(W, device=dev)  # pool indices of the nodes expanded next
        seen = torch.zeros(W, (depth - 1) * W, dtype=torch.bool, device=dev)  # their ancestors' scratch slots
        rows = torch.arange(W, device=dev)
        slot_ids = torch.arange((depth - 1) * W, device=dev)
        for d in range(1, depth):
            pool_tok, pool_score = torch.cat(toks), torch.cat(scores)
            col = (d - 1) * W + rows
            visible = seen | (slot_ids[None] == col[:, None])  # and itself (no scalar write: graph-safe)
            slots = n + col
            fed[front] = slots
            out = self.forward(pool_tok[front].clamp(max=self.vocab - 1), slots, n_logits=W, window=window,
                               tree=TreeMask((n - 1 + d).expand(W), n, visible))
            sc, tk = (self._logp(out, knobs) + pool_score[front][:, None]).topk(C, dim=-1)  # (W, C)
            first = pool_tok.shape[0]
            toks.append(tk.flatten())
            scores.append(sc.flatten())
            parents.append(front.repeat_interleave(C))
            depths.append(torch.full((W * C,), d + 1.0, device=dev))
            greedy.append((torch.cat(greedy)[front][:, None] & rank0[None]).flatten())
            if d + 1 < depth:
                best = (sc.flatten() + CHAIN_FIRST * greedy[-1]).topk(W).indices
                front = first + best
                seen = visible[best // C]
        pool_tok, pool_score, pool_parent = torch.cat(toks), torch.cat(scores), torch.cat(parents)
        # a child always ranks below its parent; the argmax chain above everything else
        key = pool_score.clamp(min=-1000.0) - 0.01 * torch.cat(depths) + CHAIN_FIRST * torch.cat(greedy)
        chosen = key.topk(self.budget).indices.sort().values  # pool order: parents before children
        frame = torch.zeros(size, dtype=torch.long, device=dev)
        frame[chosen] = torch.arange(1, self.budget + 1, device=dev)
        parent = pool_parent[chosen]
        parent_frame = torch.where(parent >= 0, frame[parent.clamp(min=0)], torch.zeros_like(parent))
        return pool_tok[chosen], parent_frame, fed[chosen], key[chosen]

    def grow(self, tokens: list[int], s: Sampling) -> Tree:
        """A tree of ``budget`` nodes after ``tokens`` (replayed from a graph in the steady state)."""
        n = len(tokens)
        window = self.model.kv.window_for(n + (self.k - 1) * self.width)
        start = self._catch_up(tokens, window)
        sampled = s.temperature > 0
        extra = sampling.Knobs.of(s, self.device).tensors() if sampled else ()
        out = self._run(("tree", sampled), self._tree, tokens[start:], start, extra, window)
        values = torch.cat([x.double() for x in out]).tolist()  # the one host sync of the draft's round
        b = self.budget
        tok, parent, fed = ([int(v) for v in values[i * b:(i + 1) * b]] for i in range(3))
        return Tree(tok, parent, values[3 * b:], fed)

    def keep(self, tree: Tree, path: list[int], n: int) -> None:
        """After the verdict: the accepted nodes the draft fed (a prefix of ``path``) move to the
        slots after the context of length ``n``."""
        fed = []
        for node in path:
            if tree.fed[node - 1] < 0:
                break
            fed.append(tree.fed[node - 1])
        self.model.keep(fed, n, tree.path_tokens(path[:len(fed)]))

    def _feed(self, tokens: list[int], start: int, window: int) -> torch.Tensor:
        """Run ``tokens`` at positions ``start...`` over ``window`` slots (the round's, so that an
        eager round computes exactly what its graph would); logits of the last position, (1, V)."""
        logits = None
        for i in range(0, len(tokens), PREFILL_CHUNK):
            piece = tokens[i:i + PREFILL_CHUNK]
            # a token the draft's (possibly smaller) vocabulary lacks can only hurt acceptance
            ids = torch.tensor(piece, dtype=torch.long, device=self.device).clamp_(max=self.vocab - 1)
            pos = torch.arange(start + i, start + i + len(piece), device=self.device)
            logits = self.forward(ids, pos, 1, window)
        self.model.kv.note(start, tokens)
        return logits

    def next_token(self, tokens: list[int]) -> int:
        """The draft's greedy guess of the token after ``tokens`` (one step over what is not cached:
        normally the last token alone). Used to assume a bonus token; it leaves the cache as a
        ``propose`` of the same context expects it (that feeds the last two tokens anew)."""
        window = self.model.kv.window_for(len(tokens))
        start = self._catch_up(tokens, window, keep=1)
        return int(self._run(("guess",), self._guess, tokens[start:], start, (), window)[-1])

    def propose(self, tokens: list[int], s: Sampling, generator: torch.Generator | None, k: int | None = None):
        """``k`` (default K) drafts after ``tokens``: (list of ids, q_idx (k, n_q) int32, q_prob (k, n_q)
        float32); ``generator`` draws a sampled round's random numbers."""
        k = self.k if k is None else k
        n = len(tokens)
        window = self.model.kv.window_for(n + k - 1)  # the last step feeds position n + k - 2
        start = self._catch_up(tokens, window)
        sampled = s.temperature > 0
        extra = ((sampling.exponentials((k, self.n_q), generator, self.device),)
                 + sampling.Knobs.of(s, self.device).tensors()) if sampled else ()
        picks, q_idx, q_prob = self._run(("chain", k, sampled), partial(self._chain, k=k), tokens[start:], start,
                                         extra, window)
        drafts = picks.tolist()  # the round's one host sync on the draft side
        self.model.kv.note(n, drafts[:-1])
        return drafts, q_idx, q_prob

    def reset(self) -> None:
        self.model.kv.reset()
