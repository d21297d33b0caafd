"""The target's distribution and its picks: the one implementation, greedy and sampled.

Contract
--------
* ``warp(logits, s)`` gives the probabilities that transformers'
  ``generate(do_sample=True, temperature=, top_k=, top_p=)`` samples from: logits cast to
  float32, then temperature, top-k, top-p (generate's order, its tie rule and its
  ``min_tokens_to_keep=1``), then softmax. ``top_k == 0`` and ``top_p >= 1`` switch a filter
  off, as in generate (whose own default top_k of 50 does not apply here). The settings may
  come as ``Knobs``, tensors on the device: a CUDA graph over ``warp`` then takes any settings
  as inputs, and the code that runs is the same whatever they are.
* ``penalize(logits, seen, penalty)`` is transformers' ``RepetitionPenaltyLogitsProcessor``
  (generate's ``repetition_penalty``), which generate() applies before the warpers: each token
  that row's context holds (``seen``, (N, V) bool) has a positive logit divided by the penalty, a
  negative one multiplied, with the same float32 operations; 1.0 changes nothing.
* ``Seen`` keeps which token ids a context holds, as counts on the device, in step with the
  context's token list (``sync``: only what changed since the last call is counted), and gives
  each row's ``seen`` from its own path below that context (``rows``): no per-row pass over the
  vocabulary on the host. Ids outside the vocabulary have no logit and are ignored, as generate()
  ignores them.
* ``picks`` (tail side) is the target's pick at each node of a tree, from its logits after
  ``penalize`` with the node's own context: its argmax when greedy, else one draw from its
  ``warp`` by ``race`` with Exp(1) noise from the stream of (seed, position). The walk down the tree (``engine.verifier``) follows the picks while they are
  children: exact for any tree the draft chooses (SpecExec's rule), since each committed token is
  the target's own pick at a node whose path equals the committed context, and the penalty at
  that node is computed from that same path: the distribution it draws from is generate()'s.
* ``round_seed`` / ``round_generator`` derive a random stream from (seed, position, role): a
  seeded chat is reproducible, a retried frame draws the same numbers, and streams of different
  positions or roles are independent, which the exactness proof requires.

This module knows nothing of models, KV caches, rounds, the wire format or I/O: it sees
logits, token ids, positions and a ``Sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from sfchat.protocol.wire import Sampling

Role = Literal["draft", "verify"]
_ROLE_IDS = {"draft": 1, "verify": 2}
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Knobs:
    """A ``Sampling``'s settings as tensors on the device, so that a captured graph takes them as
    inputs: ``temperature`` (1, 1); ``top_k`` (1, 1) long, 0 = off; ``drop_p`` (1, 1): the
    cumulative probability at or below which top-p drops a token, ``float32(1 - top_p)`` as
    generate() compares it, or -1 (nothing dropped) when top-p is off."""

    temperature: Tensor
    top_k: Tensor
    drop_p: Tensor

    @classmethod
    def of(cls, s: Sampling, device) -> "Knobs":
        return cls(torch.tensor([[s.temperature]], dtype=torch.float32, device=device),
                   torch.tensor([[s.top_k]], dtype=torch.long, device=device),
                   torch.tensor([[1 - s.top_p if s.top_p < 1.0 else -1.0]], dtype=torch.float32, device=device))

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.temperature, self.top_k, self.drop_p


def warp(logits: Tensor, s: Sampling | Knobs) -> Tensor:
    """(N, V) logits -> (N, V) float32 probabilities, as generate(do_sample=True) samples them.

    The settings are tensors (``Knobs``; a ``Sampling`` is converted), and every filter runs
    whatever they are (a filter that is off changes nothing), so the same code is a graph."""
    k = Knobs.of(s, logits.device) if isinstance(s, Sampling) else s
    # generate() casts the logits to float32 before any processor; filtering in the model's
    # dtype would move the top-k/top-p boundaries.
    scores = logits.float() / k.temperature
    # The ops below mirror TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper one
    # for one (same values compared, same sort), so the kept sets agree bit for bit, ties included.
    n, vocab = scores.shape
    descending = torch.sort(scores, dim=-1, descending=True).values
    kth = descending.gather(-1, (k.top_k - 1).clamp(0, vocab - 1).expand(n, 1))
    kth = torch.where(k.top_k > 0, kth, torch.full_like(kth, float("-inf")))
    # "<" rather than topk's indices: every token tied with the k-th one survives
    scores = scores.masked_fill(scores < kth, float("-inf"))
    ascending, order = torch.sort(scores, descending=False)
    drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= k.drop_p
    drop[..., -1:] = False  # min_tokens_to_keep=1: the most likely token always stays
    scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.softmax(dim=-1)


def penalize(logits: Tensor, seen: Tensor | None, penalty: float) -> Tensor:
    """(N, V) logits with generate()'s repetition penalty: where ``seen`` (N, V) is true, a
    positive float32 logit divided by ``penalty`` and a negative one multiplied, as
    RepetitionPenaltyLogitsProcessor computes them (a Python float, so the same kernels round
    the same way); 1.0 returns the logits as they are."""
    if penalty == 1.0:
        return logits
    if seen is None:
        raise ValueError("a repetition penalty needs each row's context tokens")
    scores = logits.float()
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


class Seen:
    """The token ids a context holds (see the module's contract), for a vocabulary of ``vocab``."""

    def __init__(self, vocab: int, device) -> None:
        self.vocab, self.device = vocab, torch.device(device)
        self.tokens: list[int] = []
        # how often each id occurs; the last entry counts the ids outside the vocabulary
        self.counts = torch.zeros(vocab + 1, dtype=torch.int32, device=device)

    def _ids(self, tokens) -> Tensor:
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device)
        return torch.where((ids >= 0) & (ids < self.vocab), ids, self.vocab)

    def sync(self, tokens: list[int]) -> None:
        """Count ``tokens`` as the context now: the ids after the common start with the last
        ``sync`` are taken off and the new ones added."""
        old, common, hi = self.tokens, 0, min(len(self.tokens), len(tokens))
        if old[:hi] == tokens[:hi]:
            common = hi
        while hi - common > 1:  # old[:common] matches, old[:hi] does not: list slices compare in C
            mid = (common + hi) // 2
            if old[common:mid] == tokens[common:mid]:
                common = mid
            else:
                hi = mid
        for part, sign in ((old[common:], -1), (tokens[common:], 1)):
            if part:
                ids = self._ids(part)
                self.counts.index_add_(0, ids, torch.full(ids.shape, sign, dtype=torch.int32, device=self.device))
        self.tokens = list(tokens)

    def rows(self, paths: list[list[int]]) -> Tensor:
        """(len(paths), vocab) bool: the context's ids and those of each row's ``path`` (its
        ancestors below the context and itself, at least one token each)."""
        width = max(len(p) for p in paths)
        ids = self._ids([p + p[-1:] * (width - len(p)) for p in paths])
        seen = (self.counts > 0).expand(len(paths), -1).clone()
        return seen.scatter_(1, ids, True)[:, :self.vocab]


def exponentials(shape, generator: torch.Generator | None, device=None) -> Tensor:
    """Exp(1) noise for ``race``, from ``generator``."""
    return torch.empty(shape, device=device if generator is None else generator.device).exponential_(
        generator=generator)


def race(weights: Tensor, noise: Tensor) -> Tensor:
    """Index along the last dim drawn with probability proportional to ``weights`` (>= 0), given
    ``noise`` of the same shape, i.i.d. Exp(1) (``exponentials``).

    Exponential race: argmax(w / E) is such a sample, and unlike torch.multinomial it needs no
    host sync, works on unnormalised weights, and its randomness is an input.
    """
    # An E of exactly 0 would make 0/0 = nan for a zero weight, and argmax picks nan.
    return (weights / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def picks(logits: Tensor, positions: list[int], s: Sampling, seen: Tensor | None = None) -> Tensor:
    """Tail side: the target's pick at each node, (n,) long from (n, V) logits at ``positions``;
    ``seen`` (n, V) bool: the tokens of each node's context, itself included (``Seen.rows``),
    needed when ``s.repetition_penalty`` is not 1.

    The logits go through ``penalize`` first. Greedy: the argmax. Sampled: a draw from ``warp`` by ``race``, with noise from the stream of the
    reply's seed and the node's position alone (``round_generator``): the node of a position that
    ends on the committed path draws the same whatever else the tree holds, so a seeded reply is
    the same for every draft, tree and frame in flight, and each committed token is an exact
    draw from the target's distribution after the committed context (the noise of a position is
    independent of everything that decided which node of that position is on the path)."""
    logits = penalize(logits, seen, s.repetition_penalty)
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    p = warp(logits, s)
    noise = torch.stack([exponentials(p.shape[-1:], round_generator(s.seed, pos, "verify", p.device))
                         for pos in positions])
    return race(p, noise)


def _mix64(x: int) -> int:
    """splitmix64 finaliser: nearby inputs give unrelated 64-bit outputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def round_seed(seed: int, start_pos: int, role: Role) -> int:
    """64-bit seed of the stream of (seed, position, role)."""
    x = 0
    for part in (seed, start_pos, _ROLE_IDS[role]):
        x = _mix64(((x ^ part) + 0x9E3779B97F4A7C15) & _MASK64)
    return x


def round_generator(seed: int, start_pos: int, role: Role,
                    device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for the node at position ``start_pos``, on ``device``.

    Only the verifier draws (the draft proposes, never samples); a role keeps any other stream
    apart from the verifier's, which the same stream would correlate with its draws.
    """
    return torch.Generator(device=device).manual_seed(round_seed(seed, start_pos, role))
