"""Scratch K/V slots after a slice's context, and who holds each.

Contract
--------
A slice (the head's, the draft, the tail's) holds its committed context in slots ``0 .. n - 1``
of its K/V and computes the nodes it has not committed yet in the ``size`` slots right after it:
``[n, n + size - 1)`` for them, the last one (``trash``) for the padding rows of a fixed-shape
forward. ``Scratch(model, size)`` is the one place that knows which key (a live tree node, a
tail's row) holds which of those slots, and the one that moves them:

* ``take(key)``: the lowest free slot, now held by ``key`` (its own when it holds one already);
  None when none is free. ``slot(key)`` tells which it holds (None: none), ``release(key)``
  gives it back.
* ``commit(keys, tokens)``: the keys' slots, in order, become the context's next positions
  ``n, n + 1, ...``: their K/V moves there in every segment of the slice (``model.move``), the
  tokens are recorded there (``model.note``) and the keys let go; a live key whose slot the
  context now covers moves, K/V and all, to a free slot after it (sources are all read before
  any destination is written). Nobody else needs to hear of it: ``slot(key)`` answers the new slot.
* ``reset(n)``: the scratch after a context of ``n`` positions, every slot free.
* ``tree_inputs(rows, shape, device)``: the inputs of a fixed-shape tree forward over the scratch
  (the head's frame, the draft's expansion step, the tail's verify all build theirs here): each
  row a key's (position, key, the keys of the ancestors it attends to), written at the key's slot
  (taken if it holds none), seeing the context, its ancestors' slots and its own; the rows padded
  to ``shape``, a padding row writing only the trash slot and seeing it (never an empty softmax;
  in the canonical form below, the context below its rope's span too).
  A canonical model's (``model.canonical``: a one-shape slice) is a ``kv.RowKeys`` instead: each
  row's last ``SPAN`` positions in order, the context's below ``n`` and its last ancestors' and
  its own slots after it (a ValueError for a row ``SPAN`` or more positions past the context).
* ``reach``: one past the last slot a tree forward over the scratch reads through its attention
  window (``ModelSlice.run(end=)``): ``end``; a canonical model's rows read only the context below
  ``n`` through it (their own positions are gathered from wherever they sit), so ``n``.

The model is duck-typed: ``move(src, dst)`` and ``note(start, tokens)`` (``model.slices.ModelSlice``).
Knows nothing about trees, rounds or the wire.
"""

from __future__ import annotations

import heapq
from typing import Hashable

import numpy as np
import torch

from sfchat.model import kv
from sfchat.model.kv import RowKeys, TreeMask


class Scratch:
    def __init__(self, model, size: int) -> None:
        if size < 2:
            raise ValueError(f"a scratch needs at least one slot besides the trash slot, not {size} slots")
        self.model, self.size = model, size
        self.n = 0
        self._slots: dict[Hashable, int] = {}
        self._free: list[int] = []
        self.reset(0)

    @property
    def trash(self) -> int:
        """The slot padding rows write to (and see): never held by a key."""
        return self.n + self.size - 1

    @property
    def free(self) -> int:
        """Slots not held by any key (the trash slot not counted)."""
        return self.size - 1 - len(self._slots)

    @property
    def end(self) -> int:
        """One past the last scratch slot."""
        return self.n + self.size

    @property
    def reach(self) -> int:
        """One past the last slot a tree forward's attention window must hold: ``end``; a canonical
        slice's rows read only the committed context through the window (their own positions are
        gathered from wherever they sit: ``kv``), so ``n`` (at least 1)."""
        return max(self.n, 1) if getattr(self.model, "canonical", False) else self.end

    def reset(self, n: int) -> None:
        self.n = n
        self._slots.clear()
        self._free = list(range(n, n + self.size - 1))  # ascending: already a heap

    def take(self, key: Hashable) -> int | None:
        if key in self._slots:
            return self._slots[key]
        if not self._free:
            return None
        slot = self._slots[key] = heapq.heappop(self._free)
        return slot

    def slot(self, key: Hashable) -> int | None:
        return self._slots.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def release(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            heapq.heappush(self._free, slot)

    def commit(self, keys: list[Hashable], tokens: list[int]) -> None:
        """The keys' slots become the context's next positions, in order (see the contract)."""
        if len(keys) != len(tokens):
            raise ValueError(f"{len(keys)} slots committed with {len(tokens)} tokens")
        if not keys:
            return
        start = self.n
        sources = [self._slots.pop(key) for key in keys]
        n = start + len(sources)
        held = set(self._slots.values())
        covered = sorted((slot, i) for i, slot in enumerate(self._slots.values()) if slot < n)
        spare = (s for s in range(n, n + self.size - 1) if s not in held)
        owners = list(self._slots)
        moves = [(slot, next(spare), owners[i]) for slot, i in covered]
        for _, new, key in moves:
            self._slots[key] = new
        self.model.move(sources + [old for old, _, _ in moves], list(range(start, n)) + [new for _, new, _ in moves])
        self.model.note(start, tokens)
        self.n = n
        held = set(self._slots.values())
        self._free = [s for s in range(n, n + self.size - 1) if s not in held]

    def tree_inputs(self, rows: list[tuple[int, Hashable, list[Hashable]]], shape: int, device
                    ) -> tuple[torch.Tensor, TreeMask | RowKeys]:
        """The slots a tree forward of ``rows`` = (position, key, ancestor keys) writes, padded to
        ``shape`` rows, and its mask over the scratch (see the contract)."""
        if len(rows) > shape:
            raise ValueError(f"{len(rows)} rows do not fit a forward of {shape}")
        base, trash = self.n, self.trash
        slots, rope = [trash] * shape, [max(base - 1, 0)] * shape
        if getattr(self.model, "canonical", False):
            for r, (pos, key, _) in enumerate(rows):
                slots[r], rope[r] = self.take(key), pos
            keys = torch.from_numpy(self._own_keys(rows, slots, shape)).to(device)
            return torch.tensor(slots, device=device), RowKeys(torch.tensor(rope, device=device), keys)
        visible = np.zeros((shape, self.size), dtype=bool)
        visible[len(rows):, trash - base] = True
        for r, (pos, key, ancestors) in enumerate(rows):
            slots[r], rope[r] = self.take(key), pos
            visible[r, [self._slots[a] - base for a in ancestors] + [slots[r] - base]] = True
        mask = TreeMask(torch.tensor(rope, device=device), torch.tensor([base], device=device),
                        torch.from_numpy(visible).to(device))
        return torch.tensor(slots, device=device), mask

    def _own_keys(self, rows, slots: list[int], shape: int) -> np.ndarray:
        """``RowKeys.keys``: the slot of each of a row's last ``SPAN`` positions, in order (-1: before
        position 0): the context's below ``n`` (slot = position), its last ancestors' after it
        (positions ``n .. p - 1``), its own last; a padding row's only the trash slot."""
        keys = np.full((shape, kv.SPAN), -1, dtype=np.int64)
        keys[len(rows):, -1] = self.trash
        for r, (pos, _, ancestors) in enumerate(rows):
            depth, lo = pos - self.n, pos - kv.SPAN + 1
            if not 0 <= depth < kv.SPAN or len(ancestors) < depth:
                raise ValueError(f"a row at position {pos} with {len(ancestors)} ancestors is not within {kv.SPAN - 1} "
                                 f"positions past the context of {self.n}")
            keys[r, max(0, -lo):self.n - lo] = np.arange(max(lo, 0), self.n)
            keys[r, self.n - lo:kv.SPAN - 1] = [self._slots[a] for a in ancestors[len(ancestors) - depth:]]
            keys[r, -1] = slots[r]
        return keys
