"""Choosing tokens and verifying drafts: the one implementation of both, greedy and sampled.

Contract
--------
* ``warp(logits, s)`` gives the probabilities that transformers'
  ``generate(do_sample=True, temperature=, top_k=, top_p=)`` samples from: logits cast to
  float32, then temperature, top-k, top-p (generate's order, its tie rule and its
  ``min_tokens_to_keep=1``), then softmax. ``top_k == 0`` and ``top_p >= 1`` switch a filter
  off, as in generate (whose own default top_k of 50 does not apply here). The settings may
  come as ``Knobs``, tensors on the device: a CUDA graph over ``warp`` then takes any settings
  as inputs, and the code that runs is the same whatever they are.
* ``choose`` (draft side) picks one token per row: the argmax when greedy, else a sample from
  q' = ``warp`` restricted to its ``n_q`` most likely tokens and renormalised, drawn by ``race``
  from Exp(1) noise handed in (``exponentials``, drawn from the round's generator outside any
  graph). q' goes to the tail sparsely (indices + probabilities); restricting the proposal keeps
  verification exact because q' is what the draft really sampled from. No host syncs and fixed
  shapes, so it can be captured in a CUDA graph, sampled rounds included.
* ``verify`` (tail side) accepts the longest acceptable draft prefix and appends one token of
  the target's own: greedy by argmax match; sampled by speculative rejection sampling
  (Leviathan et al. 2023, Chen et al. 2023), after which every committed token is distributed
  exactly as if sampled from the target's ``warp``. One host sync per call.
* ``verify_tree`` (tail side) verifies a token tree: the target's argmax at every node when
  greedy, else one independent draw per node from its ``warp``; then ``tree.walk`` descends
  from t0 while the pick is a child. Exact for any tree the draft chooses (SpecExec's rule): each
  committed token is the target's own pick at a node whose path equals the committed prefix.
  One host sync per call.
* ``round_seed`` / ``round_generator`` derive a round's random stream from (seed, start_pos,
  role): a seeded chat is reproducible, a retried round draws the same numbers, and the
  draft's and the verifier's numbers are independent, which the exactness proof requires.

This module knows nothing of models, KV caches, rounds, the wire format or I/O: it sees
logits, token ids, a sparse proposal distribution, a tree's parents and a ``Sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from sfchat.engine import tree
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


def exponentials(shape, generator: torch.Generator | None, device=None) -> Tensor:
    """Exp(1) noise for ``race``: drawn outside a graph, handed to it as an input."""
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


def choose(logits: Tensor, s: Sampling | Knobs | None, n_q: int,
           noise: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Draft side: one token per row of (N, V) logits, plus the proposal it was drawn from.

    Greedy (``s`` None, or a temperature of 0) takes the argmax and returns (N, 0) q tensors;
    otherwise the token is drawn from q' = ``warp`` restricted to its ``n_q`` likeliest tokens,
    renormalised, by ``race`` with ``noise`` (N, n_q). Returns (tokens (N,) long, q_idx (N, n_q)
    int32, q_prob (N, n_q) float32); support entries beyond q' are padded with probability 0.
    """
    n, vocab = logits.shape
    if s is None or isinstance(s, Sampling) and s.temperature == 0:
        empty = torch.empty((n, 0), device=logits.device)
        return logits.argmax(dim=-1), empty.int(), empty.float()
    if n_q < 1:
        raise ValueError("sampled drafting needs n_q >= 1 proposal entries per position")
    top = torch.topk(warp(logits, s), min(n_q, vocab), dim=-1)
    q_prob = top.values / top.values.sum(dim=-1, keepdim=True)
    q_idx = top.indices
    if n_q > vocab:  # a vocabulary smaller than n_q (tiny models): keep the width fixed
        q_prob = F.pad(q_prob, (0, n_q - vocab))
        q_idx = F.pad(q_idx, (0, n_q - vocab))
    tokens = q_idx.gather(1, race(q_prob, noise)[:, None]).squeeze(1)
    return tokens, q_idx.int(), q_prob


def _outside_to(index: Tensor, vocab: int) -> Tensor:
    """Map token ids outside [0, vocab) to ``vocab``: a spare zero-probability column."""
    return torch.where((index >= 0) & (index < vocab), index, vocab)


def _prefix_len(accepted: Tensor) -> Tensor:
    """Number of leading True values, as a 0-d long tensor (0 for an empty input)."""
    return accepted.long().cumprod(dim=0).sum()


def verify(logits: Tensor, drafts: Tensor, s: Sampling, q_idx: Tensor, q_prob: Tensor,
           generator: torch.Generator | None) -> tuple[int, list[int]]:
    """Tail side: accept a prefix of ``drafts`` and append the target's own next token.

    logits (K+1, V) are the target's at [t0, d1..dK]; drafts (K,); q_idx/q_prob (K, n_q) the
    draft's sparse proposals (ignored when greedy). Returns (n_accepted, tokens) with
    ``tokens == drafts[:n_accepted] + [next]``.
    """
    k, vocab = drafts.shape[0], logits.shape[-1]
    # Inputs may arrive on the host (decoded from the wire). A non_blocking copy from pageable
    # memory is staged at once and, unlike a blocking one, does not wait for the device, so the
    # .tolist() below stays the only host sync.
    device = logits.device
    drafts = drafts.to(device=device, dtype=torch.long, non_blocking=True)
    if s.temperature == 0:
        best = logits.argmax(dim=-1)
        n = _prefix_len(best[:k] == drafts)
        nxt = best.index_select(0, n.view(1))
    else:
        if k and q_idx.shape[-1] == 0:
            raise ValueError("sampled verification needs the draft's proposal distributions")
        # Column `vocab` stands for every token the target vocabulary lacks (the draft's may be
        # larger): p is 0 there, so such drafts are always rejected and their q' mass is never
        # subtracted from a real token.
        p = F.pad(warp(logits, s), (0, 1))
        # q has K+1 rows; the last stays 0, so the "residual" after K acceptances is p_K itself
        # and the bonus token needs no separate branch.
        q = torch.zeros_like(p)
        q_idx = q_idx.to(device=device, dtype=torch.long, non_blocking=True)
        q[:k].scatter_add_(1, _outside_to(q_idx, vocab),
                           q_prob.to(device=device, dtype=torch.float32, non_blocking=True))
        d = _outside_to(drafts, vocab)[:, None]
        p_d, q_d = p[:k].gather(1, d).squeeze(1), q[:k].gather(1, d).squeeze(1)
        u = torch.rand(k, device=device, generator=generator)
        # u < p/q with u ~ U[0,1) accepts with probability min(1, p/q); multiplying instead of
        # dividing keeps p = 0 always rejected, even if q' (wrongly) lacks the draft token.
        n = _prefix_len(u * q_d < p_d)
        row = n.view(1)
        p_n = p.index_select(0, row)
        residual = (p_n - q.index_select(0, row)).clamp_min_(0)
        # In exact arithmetic a rejection implies some p > q'; rounding can leave nothing, and
        # p is then the right limit (the rejection itself had probability ~0).
        residual = torch.where(residual.sum() > 0, residual, p_n)
        nxt = race(residual, exponentials(residual.shape, generator, device))
    out = torch.cat([n.view(1), drafts, nxt]).tolist()  # the one host sync
    n_accepted = out[0]
    return n_accepted, out[1:1 + n_accepted] + [out[-1]]


def verify_tree(logits: Tensor, parents, tokens, s: Sampling, generator: torch.Generator | None
                ) -> tuple[list[int], list[int]]:
    """Tail side, a tree: logits (N+1, V) at [t0, node 1..N], ``parents``/``tokens`` the nodes'.
    Returns (accepted node indices, committed tokens: the accepted nodes' and one more)."""
    if s.temperature == 0:
        picks = logits.argmax(dim=-1)
    else:
        p = warp(logits, s)
        picks = race(p, exponentials(p.shape, generator, p.device))
    path, nxt = tree.walk(parents, tokens, picks.tolist())  # the one host sync
    return path, [tokens[i - 1] for i in path] + [nxt]


def _mix64(x: int) -> int:
    """splitmix64 finaliser: nearby inputs give unrelated 64-bit outputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def round_seed(seed: int, start_pos: int, role: Role) -> int:
    """64-bit seed of one round's random stream (for re-seeding a graph-registered generator)."""
    x = 0
    for part in (seed, start_pos, _ROLE_IDS[role]):
        x = _mix64(((x ^ part) + 0x9E3779B97F4A7C15) & _MASK64)
    return x


def round_generator(seed: int, start_pos: int, role: Role,
                    device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for the round starting at ``start_pos``, on ``device``.

    The draft (``choose``) and the verifier (``verify``) must use different roles: the same
    stream on both sides would correlate the drafted tokens with their acceptance tests.
    """
    return torch.Generator(device=device).manual_seed(round_seed(seed, start_pos, role))
