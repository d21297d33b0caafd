"""Tree masks for tests that run a slice's tree forward by hand: node i (0: t0) of a frame written
from slot ``t0_pos`` on sees its ancestors and itself, at rotary position ``t0_pos + depth``."""

from __future__ import annotations

import torch

from sfchat.model.kv import TreeMask


def tree_mask(parents, t0_pos: int, device="cpu") -> TreeMask:
    m = len(parents) + 1
    visible = torch.eye(m, dtype=torch.bool)
    depth = [0]
    for i, p in enumerate(parents, start=1):
        visible[i] |= visible[p]
        depth.append(depth[p] + 1)
    return TreeMask((torch.tensor(depth) + t0_pos).to(device), torch.tensor([t0_pos], device=device),
                    visible.to(device))
