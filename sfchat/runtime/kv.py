"""Static KV cache with positional rewind, shared by the draft model and both target slices.

Contract
--------
* Buffers are allocated once (``max_len`` slots per layer) and never reallocated, so the
  forwards that use them can be captured in CUDA graphs.
* Before a forward, the caller sets the absolute positions of the new tokens with
  ``begin(positions)``; transformers' attention modules then call ``update(k, v, layer_idx)``,
  which writes the new keys/values at those positions (``index_copy_``) and returns the whole
  buffers. ``mask`` is the matching additive mask: query at position p sees slots 0..p and
  nothing else, so slots beyond the committed context (rejected drafts, stale turns) are
  invisible without being cleared. Rewind is free: the next forward simply writes at an
  earlier position.
* ``written`` records which token id sits at each slot, so ``reusable(tokens)`` can tell how
  much of a new context is already cached (multi-turn reuse, draft catch-up).

The cache knows nothing about models or rounds; it is duck-typed to what the decoder layers
of transformers call (``update``), not a subclass of transformers' ``Cache``.
"""

from __future__ import annotations

import torch


class StaticKV:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (1, n_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.slots = torch.arange(max_len, device=device)
        self.neg = torch.finfo(dtype).min
        self.dtype = dtype
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, 1, 1, max_len, dtype=dtype, device=device)
        self.written: list[int] = []

    # -- used by the forward that owns this cache ---------------------------------------------
    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        """Set the positions of the next forward; returns the (1, 1, n, max_len) additive mask."""
        self.positions = positions
        visible = self.slots[None, :] <= positions[:, None]
        zero = torch.zeros((), dtype=self.dtype, device=positions.device)
        self.mask = torch.where(visible, zero, torch.full_like(zero, self.neg))[None, None]
        return self.mask

    # -- called by transformers' attention modules -----------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.positions, key_states.to(k.dtype))
        v.index_copy_(2, self.positions, value_states.to(v.dtype))
        return k, v

    # -- bookkeeping of what the slots hold ------------------------------------------------------
    def note(self, start: int, tokens) -> None:
        """Record that ``tokens`` were written at ``start``...; later slots become stale."""
        del self.written[start:]
        if len(self.written) < start:
            raise ValueError(f"KV hole: writing at {start} but only {len(self.written)} slots are filled")
        self.written.extend(int(t) for t in tokens)

    def reusable(self, tokens) -> int:
        """Length of the longest prefix of ``tokens`` whose KV is already in the cache.

        Called every round over the whole context: prefix equality is monotone, so a binary
        search of list-slice comparisons (done in C) replaces a Python loop over every token."""
        tokens = list(tokens)
        n = min(len(self.written), len(tokens))
        if self.written[:n] == tokens[:n]:
            return n
        lo, hi = 0, n  # written[:lo] matches, written[:hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.written[lo:mid] == tokens[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo

    def reset(self) -> None:
        self.written.clear()
