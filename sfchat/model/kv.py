"""Static KV cache with positional rewind, shared by the draft model and both target slices.

Contract
--------
* Buffers are allocated once (``max_len`` slots per layer; a canonical cache's ``total``, below;
  one tensor for every layer's keys and values, each layer's a view of it) and never
  reallocated, so the forwards that use them can be captured in CUDA graphs.
* Before a forward, the caller sets the absolute positions of the new tokens with
  ``begin(positions, window)``; transformers' attention modules then call
  ``update(k, v, layer_idx)``, which writes the new keys/values at those positions
  (``index_copy_``) and returns the first ``window`` slots of the buffers (views, no copy).
  ``mask`` is the matching additive mask: query at position p sees slots 0..p and nothing
  else, so slots beyond the committed context (rejected drafts, stale turns) are invisible
  without being cleared. Rewind is free: the next forward simply writes at an earlier position.
* Attention work grows with the window, not with the context, so a forward attends over the
  smallest of ``windows`` (powers of two from ``MIN_WINDOW``, then ``max_len``) that holds its
  last position: ``window_for(end)``. A fixed set of windows keeps the shapes fixed, so each
  can have its CUDA graph; a masked slot adds exactly nothing to the attention, so the window
  changes no result beyond floating-point summation order.
* Token trees (``TreeMask``): a forward may write its tokens at slots that are not their
  positions. ``begin(slots, window, tree)`` then builds the mask from the tree instead: a query
  sees every slot before ``tree.base`` (the committed context) and, of the ``R`` slots from
  ``tree.base`` on, those its row of ``tree.visible`` marks (its ancestors and itself); the
  rotary positions are the tree's ``rope``. Every field is a tensor, so the mask is an input of
  a CUDA graph. After a verdict ``move(src, dst)`` copies the accepted nodes' keys and values
  in place to the contiguous slots after the context (no reallocation; other slots untouched).
* Which token sits at each slot is the owning slice's record (``ModelSlice.note``), kept once
  for all of its segments' caches.
* Canonical attention (``canonical``: a one-shape slice's cache, ``ModelSlice(rows=)``). A GPU
  kernel sums a row's keys in the order of their slots, and its tiles follow the window: so that a
  row's arithmetic depends on nothing but its own query and keys, the cache attends in one fixed
  form. The buffers hold ``total`` slots (``max_len`` and the sink slot at ``max_len``, where a
  padded plain forward's padding rows write, rounded up to ``BLOCK``); ``begin`` returns an
  ``Attend`` (read by ``model.attention``): a row at position ``p`` attends to (1) the context
  slots below ``p - SPAN + 1`` (slot = position there), in the blocks of ``BLOCK`` slots that the
  window covers (``context_slots(window)``: ``windows`` as above, the last all ``total``; a block
  past a row's context weighs exactly nothing, so the window changes no row whose context part it
  holds), and (2) its own last ``SPAN`` positions ``p - SPAN + 1 .. p``, gathered in position order
  from wherever they sit (``RowKeys.keys``; a plain forward's at slot = position), every part
  merged by its log-sum-exp. A row may sit at most ``SPAN - 1`` positions past the committed
  context, so that every key of part (1) is the context's, and a tree forward's window need only
  hold the committed context; ``update`` returns the whole buffers.
* Attention in blocks (a plain cache's tree forwards, ``in_blocks(block, from_window)``: the
  draft's). Over a window of at least ``from_window`` slots (a multiple of ``block``), ``begin``
  returns ``Blocks`` instead of the mask tensor: the same mask, its rows repeated for each query
  head of a key head, which ``model.attention`` runs over the window cut in blocks of ``block``
  slots side by side (a step's few rows over a long window fill a GPU no other way). Plain
  forwards and shorter windows keep the mask tensor. The draft's cache holds whole blocks
  (``draft_slots``), so its widest window runs in blocks too.

The cache knows nothing about models or rounds; it is duck-typed to what the decoder layers
of transformers call (``update``), not a subclass of transformers' ``Cache``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

SPAN = 128  # a canonical row's own last positions, gathered in order (head and tail alike: a protocol constant)
BLOCK = 512  # a canonical cache's slots round up to this: its context part runs in blocks of it, side by side
PREFILL_CHUNK = 512  # positions per forward when a long context is fed (head, draft, memory estimate)
DRAFT_BLOCK = 128  # the draft's attention in blocks (``in_blocks``): its cache holds whole blocks (``draft_slots``)
MIN_WINDOW = 512  # below this many slots a narrower attention saves nothing measurable on a GPU


def windows_for(max_len: int, min_window: int | None = None) -> list[int]:
    """The attention windows of a cache of ``max_len`` slots, ascending, ending at ``max_len``."""
    w = min_window or MIN_WINDOW
    out = []
    while w < max_len:
        out.append(w)
        w *= 2
    return out + [max_len]


@dataclass(frozen=True)
class TreeMask:
    """Where a tree forward's queries look: slots before ``base`` (1,) all, the ``R`` slots from
    ``base`` on as ``visible`` (n, R) bool says, nothing after them; ``rope`` (n,) their positions."""

    rope: torch.Tensor
    base: torch.Tensor
    visible: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rope, self.base, self.visible


@dataclass(frozen=True)
class RowKeys:
    """A canonical tree forward's rows: ``rope`` (n,) their positions, ``keys`` (n, SPAN) the slot
    holding each of a row's last ``SPAN`` positions ``p - SPAN + 1 .. p``, in order (-1: none)."""

    rope: torch.Tensor
    keys: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope, self.keys


@dataclass(frozen=True)
class Attend:
    """What canonical attention reads (``model.attention``): ``bias`` (group * n, context_slots(window))
    the additive mask of the context part, rows repeated for each query head of a key head;
    ``context`` (blocks, n) whether a row has keys in each block of ``BLOCK`` slots of it; ``keys``
    (n, SPAN) the slots of a row's own part, in position order; ``own`` (n, SPAN) its additive mask
    (0 for the positions a row has, the dtype's lowest for the others)."""

    bias: torch.Tensor
    context: torch.Tensor
    keys: torch.Tensor
    own: torch.Tensor


@dataclass(frozen=True)
class Blocks:
    """A tree forward's attention in blocks (``model.attention.in_blocks``): ``bias`` (group * n,
    window) the additive mask, rows repeated for each query head of a key head; ``block`` slots a
    block (the window a multiple of it)."""

    bias: torch.Tensor
    block: int


def draft_slots(max_len: int) -> int:
    """The draft's cache for a context and scratch of ``max_len`` slots: rounded up to whole
    ``DRAFT_BLOCK``s, so that its widest window (all of it) runs in blocks too."""
    return -(-max_len // DRAFT_BLOCK) * DRAFT_BLOCK


def cache_slots(max_len: int, canonical: bool) -> int:
    """The slots a cache of ``max_len`` holds: a canonical one's sink and the rounding to ``BLOCK`` too."""
    return -(-(max_len + 1) // BLOCK) * BLOCK if canonical else max_len


def causal_keys(positions: torch.Tensor) -> torch.Tensor:
    """The ``RowKeys.keys`` of rows whose last ``SPAN`` positions sit at slot = position."""
    keys = positions[:, None] + torch.arange(1 - SPAN, 1, device=positions.device)[None]
    return torch.where(keys >= 0, keys, torch.full_like(keys, -1))


class StaticKV:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, canonical: bool = False, group: int = 1):
        self.canonical, self.group = canonical, group  # group: query heads per key head
        self.total = cache_slots(max_len, canonical)
        # every layer's keys and values in one buffer (2, layers, 1, heads, slots, dim), each layer's a
        # view: a verdict's move and a clear are one call for them all, not one per layer and tensor
        self.buffer = torch.zeros((2, n_layers, 1, n_kv_heads, self.total, head_dim), dtype=dtype, device=device)
        self.keys, self.values = list(self.buffer[0]), list(self.buffer[1])
        self.max_len = max_len
        self.slots = torch.arange(self.total, device=device)
        self.neg = torch.finfo(dtype).min
        self.dtype = dtype
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, 1, 1, max_len, dtype=dtype, device=device)
        self.windows = windows_for(max_len)
        self.window = max_len
        self.block, self.blocks_from = 0, 0  # a tree forward's attention in blocks: off (``in_blocks``)

    def in_blocks(self, block: int, from_window: int) -> None:
        """Run a tree forward's attention in blocks of ``block`` slots over any window of at least
        ``from_window`` slots that is a multiple of ``block`` (``Blocks``); ``block`` 0: never."""
        if self.canonical and block:
            raise ValueError("a canonical cache attends in its own form")
        self.block, self.blocks_from = block, from_window

    # -- used by the forward that owns this cache ---------------------------------------------
    def window_for(self, end: int) -> int:
        """The smallest window holding positions ``0 .. end - 1``."""
        if not 0 < end <= self.max_len:
            raise ValueError(f"a forward ending at position {end} does not fit a cache of {self.max_len} slots")
        return self.windows[bisect.bisect_left(self.windows, end)]

    def context_slots(self, window: int | None) -> int:
        """A canonical cache's slots that the context part reads for ``window`` (all when None):
        the window rounded up to whole blocks of ``BLOCK``, at most ``total``."""
        return min(-(-(window or self.total) // BLOCK) * BLOCK, self.total)

    def begin(self, positions: torch.Tensor, window: int | None = None, tree: TreeMask | None = None
              ) -> torch.Tensor:
        """Set the slots the next forward writes (``positions``) and attends over (``window``,
        default all; every position must lie inside it): the (1, 1, n, window) additive mask,
        causal by slot, or the tree's (see ``TreeMask``; as ``Blocks`` over a long window where
        ``in_blocks`` says so); a canonical cache's ``Attend`` instead,
        its context part over ``context_slots(window)`` (which need hold only every row's context
        part: a tree's rows write scratch slots past it, read through their own part)."""
        if self.canonical:
            return self._attend(positions, tree, self.context_slots(window))
        self.positions = positions
        self.window = window or self.max_len
        if tree is None:
            visible = self.slots[None, :self.window] <= positions[:, None]
        else:
            n, span = tree.visible.shape
            rel = self.slots[None, :self.window] - tree.base[:, None]  # (1, window): slot - base
            inside = (rel >= 0) & (rel < span)
            picked = tree.visible.gather(1, rel.clamp(0, span - 1).expand(n, -1))
            visible = (rel < 0) | (inside & picked)
        zero = torch.zeros((), dtype=self.dtype, device=positions.device)
        self.mask = torch.where(visible, zero, torch.full_like(zero, self.neg))[None, None]
        if tree is not None and self.block and self.window >= self.blocks_from and self.window % self.block == 0:
            return Blocks(self.mask[0, 0].repeat(self.group, 1), self.block)
        return self.mask

    def _attend(self, positions: torch.Tensor, rows: RowKeys | None, width: int) -> Attend:
        """A canonical forward writing ``positions`` (slots), its context part over the first
        ``width`` slots: its ``Attend`` (a plain forward's rows at slot = position, the sink's
        included)."""
        if rows is None:
            rows = RowKeys(positions, causal_keys(positions))
        self.positions = positions
        cut = rows.rope - (SPAN - 1)  # part (1): the slots below a row's own positions
        zero = torch.zeros((), dtype=self.dtype, device=positions.device)
        bias = torch.where(self.slots[None, :width] < cut[:, None], zero, torch.full_like(zero, self.neg))
        starts = torch.arange(0, width, BLOCK, device=positions.device)
        own = torch.where(rows.keys >= 0, zero, torch.full_like(zero, self.neg))
        self.mask = Attend(bias.repeat(self.group, 1), cut[None, :] > starts[:, None], rows.keys.clamp(min=0), own)
        return self.mask

    # -- called by transformers' attention modules -----------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.positions, key_states.to(k.dtype))
        v.index_copy_(2, self.positions, value_states.to(v.dtype))
        if self.canonical:
            return k, v
        return k[:, :, :self.window], v[:, :, :self.window]

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of slots ``src`` to slots ``dst`` in every layer (the two may
        overlap: all sources are read before any destination is written)."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if not pairs:
            return
        device = self.buffer.device
        s = torch.tensor([p[0] for p in pairs], device=device)
        d = torch.tensor([p[1] for p in pairs], device=device)
        self.buffer.index_copy_(4, d, self.buffer.index_select(4, s))  # every layer's slots at once

    def clear(self) -> None:
        """Zero every slot (a peer's NaN left in a slot that a later forward's window covers would
        poison its softmax, masked or not)."""
        self.buffer.zero_()
