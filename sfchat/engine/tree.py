"""Token trees on the host: their shape, their attention mask, prompt-lookup branches, the walk.

Contract
--------
A tree of ``N`` draft tokens hangs under t0, the last committed token. Frame order is what the
wire carries: index 0 is t0, nodes are 1..N, and every node's parent (``parents[i - 1]`` for
node ``i``) comes before it, so depths and masks are built in one pass. A node at depth ``d``
sits at position ``t0's + d`` and attends to the committed context and to its own ancestors
(``mask``); in the KV cache the frame's tokens occupy consecutive scratch slots from t0's.

* ``Tree`` is what the draft grew: node tokens, parents, each node's rank (``scores``: the
  draft's cumulative log-probability of its path, the draft's argmax chain raised above all)
  and the draft KV slot each node was fed at (``fed``, -1 when the draft never ran it: leaves,
  grafted branches).
* ``lookup(context, length)`` finds the latest earlier occurrence of the context's last few
  tokens and returns what followed it: a branch that costs no draft compute (it wins where the
  reply repeats its context: summaries, retrieval, code edits). ``graft`` adds such a branch to a
  tree, sharing the nodes it already has and dropping the lowest-scoring leaves to stay at N.
* ``walk(parents, tokens, picks)`` is verification's descent: from t0, follow ``picks[node]``
  (the target's argmax, or its draw at that node) while it is a child; the pick at the node
  where it stops is the next token. Greedy this gives exactly the target's own continuation;
  with independent draws from the target's distribution at each node, an exact sample.

No I/O, no models; the draft builds trees on the GPU (``draft.Drafter.grow``), this module only
reshapes what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sfchat.protocol import wire
from sfchat.model.kv import TreeMask

LOOKUP_NGRAMS = (4, 3, 2)  # suffix lengths tried, longest first
LOOKUP_WINDOW = 8192  # tokens of context searched


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    fed: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of each node (t0 excluded)."""
        return wire.tree_depths(self.parents)[1:]

    def path_tokens(self, path) -> list[int]:
        return [self.tokens[i - 1] for i in path]

    def likeliest(self) -> list[int]:
        """The path the draft ranks first: from t0, each time the best-ranked child (the draft's
        argmax chain, which ``graft`` never drops)."""
        best: dict[int, int] = {}
        for i, p in enumerate(self.parents, start=1):
            if p not in best or self.scores[i - 1] > self.scores[best[p] - 1]:
                best[p] = i
        path, node = [], 0
        while node in best:
            node = best[node]
            path.append(node)
        return path


def mask(parents, t0_pos: int, device, depths: list[int] | None = None) -> TreeMask:
    """The mask of a tree frame written from slot ``t0_pos`` on: t0 and node ``i`` at slot
    ``t0_pos + i``, rotary position ``t0_pos + depth``, each seeing its ancestors and itself
    (``depths``: ``wire.tree_depths(parents)``, when the caller has them already)."""
    m = len(parents) + 1
    visible = np.eye(m, dtype=bool)
    for i, p in enumerate(parents, start=1):
        visible[i] |= visible[p]
    depths = np.asarray(wire.tree_depths(parents) if depths is None else depths, dtype=np.int64)
    return TreeMask(rope=torch.from_numpy(depths + t0_pos).to(device),
                    base=torch.tensor([t0_pos], device=device),
                    visible=torch.from_numpy(visible).to(device))


def walk(parents, tokens, picks) -> tuple[list[int], int]:
    """(accepted node indices, next token): descend from t0 while ``picks[node]`` is a child."""
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens), start=1)}
    node, path = 0, []
    while (node, picks[node]) in children:
        node = children[(node, picks[node])]
        path.append(node)
    return path, picks[node]


def lookup(context: list[int], length: int) -> list[int]:
    """Up to ``length`` tokens that followed the latest earlier occurrence of the context's last
    ``LOOKUP_NGRAMS`` tokens (longest suffix first); [] when there is none."""
    if length <= 0:
        return []
    a = np.asarray(context[-LOOKUP_WINDOW:], dtype=np.int64)
    n = len(a)
    for g in LOOKUP_NGRAMS:
        if n <= g:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(a[:-1], g)  # starts 0 .. n - 1 - g
        hits = np.nonzero((windows == a[-g:]).all(axis=1))[0]
        if len(hits):
            j = int(hits[-1]) + g
            return a[j:j + length].tolist()
    return []


def graft(tree: Tree, branch: list[int]) -> Tree:
    """``tree`` with ``branch`` hanging from t0: nodes it shares are reused, each new node
    replaces the lowest-scoring leaf that is not on the branch (the tree keeps its size; when no
    leaf is left to drop, the branch is cut there)."""
    parents, tokens = list(tree.parents), list(tree.tokens)
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens), start=1)}
    node, rest = 0, list(branch)
    while rest and (node, rest[0]) in children:
        node = children[(node, rest.pop(0))]
    if not rest:
        return tree
    alive = [True] * (len(tokens) + 1)
    n_children = [0] * (len(tokens) + 1)
    for p in parents:
        n_children[p] += 1
    protected = {node}
    while node:
        node = parents[node - 1]
        protected.add(node)
    dropped = 0
    for _ in rest:
        leaves = [i for i in range(1, len(tokens) + 1) if alive[i] and not n_children[i] and i not in protected]
        if not leaves:
            break
        worst = min(leaves, key=lambda i: (tree.scores[i - 1], -i))
        alive[worst] = False
        n_children[parents[worst - 1]] -= 1
        dropped += 1
    rest = rest[:dropped]
    if not rest:
        return tree
    renumber = {0: 0}
    out = Tree([], [], [], [])
    for i in range(1, len(tokens) + 1):
        if alive[i]:
            renumber[i] = len(out.tokens) + 1
            out.tokens.append(tokens[i - 1])
            out.parents.append(renumber[parents[i - 1]])
            out.scores.append(tree.scores[i - 1])
            out.fed.append(tree.fed[i - 1])
    attach = renumber[max(protected)]  # the deepest shared node: protected holds it and its ancestors
    for t in rest:
        out.tokens.append(t)
        out.parents.append(attach)
        out.scores.append(float("-inf"))
        out.fed.append(-1)
        attach = len(out.tokens)
    return out
