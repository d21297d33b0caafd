"""The draft model: proposes K tokens per round from the committed context.

Contract
--------
``Drafter.propose(tokens, sampling, generator)`` takes the whole committed context (token ids)
and returns K proposed continuations plus the sparse proposal distributions they were drawn
from (empty when greedy). It keeps its own static KV cache in step with the context by
itself: whatever prefix of ``tokens`` is already cached is reused (multi-turn, rejected
drafts), the rest is fed first. In the steady state the feed is exactly the last two committed
tokens (re-writing one already-cached position): this covers both "some drafts rejected"
(one new token) and "all K accepted" (d_K was never fed to the draft, plus the bonus), and it
gives every round the same shapes, which is what lets the round be captured in a CUDA graph
(one per attention window, see ``kv.StaticKV.windows``; a compiled draft has one graph, over
all slots, so that it is compiled once).

The drafter knows nothing about the target, the wire or acceptance.
"""

from __future__ import annotations

import torch

from sfchat.runtime import sampling
from sfchat.runtime.kv import PREFILL_CHUNK
from sfchat.runtime.graphs import Graphed, capture_windows, pick
from sfchat.runtime.slices import ModelSlice
from sfchat.wire import Sampling

GREEDY = Sampling()


class Drafter:
    def __init__(self, model: ModelSlice, k: int, n_q: int = 32):
        self.model, self.k, self.n_q = model, k, n_q
        self.device = model.device
        self.vocab = model.config.vocab_size
        self.two = torch.arange(2, device=self.device)
        self.graphs: dict[int, Graphed] = {}  # attention window -> the greedy round's graph
        self.guess_graphs: dict[int, Graphed] = {}  # attention window -> the one-token greedy step

    def capture(self, log=None, compile: bool = False) -> bool:
        """Capture the steady-state greedy round (2-token feed + K-1 steps) as one CUDA graph per
        attention window (one graph over all slots when compiled: each window would be compiled
        anew, and a compiled round over all slots still beats an uncompiled one over few).

        With ``compile``, the draft's forward is first compiled by torch.compile (Inductor fuses
        the many small elementwise kernels of a small model's decode step); the compiled code
        then runs inside the hand-captured graph. Compiled numerics differ slightly from eager,
        which is harmless here: a draft token is only a proposal, the target decides."""
        forward = self.model.forward
        if compile:
            forward = torch.compile(self.model.forward, dynamic=False)
        ids = torch.zeros(2, dtype=torch.long, device=self.device)
        start = torch.zeros(1, dtype=torch.long, device=self.device)
        kv = self.model.kv
        windows = [kv.max_len] if compile else [w for w in kv.windows if w > self.k]
        self.graphs = capture_windows(f"draft's {self.k}-step round",
                                      lambda a, b, w: self._graphed_round(a, b, forward, w), (ids, start), windows, log)
        # the guess of a bonus token while a verdict travels (``next_token``): one step, not compiled
        # (a compiled forward would compile again for the one-token shape)
        self.guess_graphs = capture_windows(
            "draft's one-token step", lambda a, b, w: self.model.forward(a, b, 1, w).argmax(-1),
            (ids[:1], start), list(kv.windows), log)
        return bool(self.graphs)

    def _graphed_round(self, ids: torch.Tensor, start: torch.Tensor, forward, window: int):
        logits = forward(ids, start + self.two, n_logits=1, window=window)
        return self._steps(logits, start + 2, GREEDY, 0, None, forward, window)

    def _steps(self, logits, next_pos: torch.Tensor, s: Sampling, n_q: int, generator, forward, window: int):
        """K drafts from the logits after the context; no host sync, so it can be graphed."""
        picks, q_idx, q_prob = [], [], []
        for i in range(self.k):
            tok, qi, qp = sampling.choose(logits, s, n_q, generator)
            picks.append(tok)
            q_idx.append(qi)
            q_prob.append(qp)
            if i + 1 < self.k:
                logits = forward(tok, next_pos + i, n_logits=1, window=window)
        return torch.cat(picks), torch.cat(q_idx), torch.cat(q_prob)

    def reset(self) -> None:
        self.model.kv.reset()

    def _feed(self, tokens: list[int], start: int, window: int) -> torch.Tensor:
        """Run ``tokens`` at positions ``start...`` over ``window`` slots (the round's, so that an
        eager round computes exactly what its graph would); logits of the last position, (1, V)."""
        logits = None
        for i in range(0, len(tokens), PREFILL_CHUNK):
            piece = tokens[i:i + PREFILL_CHUNK]
            # a token the draft's (possibly smaller) vocabulary lacks can only hurt acceptance
            ids = torch.tensor(piece, dtype=torch.long, device=self.device).clamp_(max=self.vocab - 1)
            pos = torch.arange(start + i, start + i + len(piece), device=self.device)
            logits = self.model.forward(ids, pos, 1, window)
        self.model.kv.note(start, tokens)
        return logits

    def next_token(self, tokens: list[int]) -> int:
        """The draft's greedy guess of the token after ``tokens`` (one step over what is not cached:
        normally the last token alone). Used to assume a bonus token; it leaves the cache as a
        ``propose`` of the same context expects it (that feeds the last two tokens anew)."""
        n = len(tokens)
        kv = self.model.kv
        start = min(kv.reusable(tokens), n - 1)
        window = kv.window_for(n)
        graph = pick(self.guess_graphs, window) if start == n - 1 else None
        if graph is None:
            return int(self._feed(tokens[start:], start, window)[-1].argmax())
        ids = torch.tensor(tokens[-1:], dtype=torch.long).clamp_(max=self.vocab - 1)
        guess = int(graph(ids, torch.tensor([start]))[0])
        kv.note(start, tokens[-1:])
        return guess

    def propose(self, tokens: list[int], s: Sampling, generator: torch.Generator | None):
        """K drafts after ``tokens``: (list of ids, q_idx (K, n_q) int32, q_prob (K, n_q) float32)."""
        n = len(tokens)
        kv = self.model.kv
        start = min(kv.reusable(tokens), n - 1, max(n - 2, 0))
        window = kv.window_for(n + self.k - 1)  # the last step feeds position n + K - 2
        graph = pick(self.graphs, window) if s.temperature == 0 and n - start == 2 else None
        if graph is not None:
            ids = torch.tensor(tokens[-2:], dtype=torch.long).clamp_(max=self.vocab - 1)
            picks, q_idx, q_prob = graph(ids, torch.tensor([start]))
            kv.note(start, tokens[-2:])
        else:
            logits = self._feed(tokens[start:], start, window)
            n_q = self.n_q if s.temperature > 0 else 0
            next_pos = torch.tensor([n], device=self.device)
            picks, q_idx, q_prob = self._steps(logits, next_pos, s, n_q, generator, self.model.forward, window)
        drafts = picks.tolist()  # the round's one host sync on the draft side
        self.model.kv.note(n, drafts[:-1])
        return drafts, q_idx, q_prob
