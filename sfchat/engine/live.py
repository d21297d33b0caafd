"""The head's speculation tree of one reply: it lives across the frames in flight. Torch-free.

Contract
--------
The committed context ends with the **root**: the node of the last committed token, whose
continuation the target has not computed yet. Every other live node hangs below it. A node
is a candidate (a continuation the draft proposed, not sent), or sent (in a frame in flight,
under an id), and the draft may have **expanded** it (run on it: its own candidates exist).
A node's ``value`` is the probability that it ends on the committed path: the product, from
the root down, of each step's calibrated probability that the target picks that token
(``Calibration``: the share of the draft's proposals at that confidence that the target picked,
measured on every committed node). The sum of a frame's values is its expected yield in
committed tokens.

* ``expandable(width)``: the likeliest live nodes the draft has not expanded yet (the root first);
  ``expanded(node, proposals)`` records the draft's ranked ``(token, probability)`` continuations
  of one as candidates; ``graft(tokens)`` hangs a prompt-lookup continuation under the root.
* ``expected(budget, max_pos)``: the expected yield of a frame of the best ``budget`` live nodes
  from the root, sent or not, before ``max_pos`` (a forecast of one frame per round trip), and
  the deepest position they reach.
* ``choose(budget, max_pos)``: the frame: the root if it was not sent yet, then the likeliest candidates
  whose parents are sent or chosen, best first (a path's value never rises, so the best nodes'
  ancestors are among them); ``send(nodes)`` gives each the next id.
* ``take(frame, path, picks, vocab)``: the verdict of one frame, checked (``ProtocolError`` for anything the
  frame cannot have produced): its path must start at the root, if the root was in that frame, and
  go down the frame's nodes, each the target's pick at the one before. Returns the committed
  tokens and the nodes that died; the root moves to the child of the last committed node whose
  token is the last pick (a live node when one was sent or proposed, else a new one), and every
  node not below it is dead. ``take`` feeds the calibration with each committed node's proposals.

The tree owns no memory: the K/V slots its nodes hold in the draft's and the head slice's scratch
are each scratch's to hand out, move and free (``engine.scratch.Scratch``, keyed by node).
No models, no wire, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

CALIBRATION_BINS = 20
RANK_BINS = 4  # ranks told apart by the calibration: the first, second, third and the rest
PRIOR_WEIGHT = 1.0  # pseudo-observations at the prior (the draft's own probability) per bin
LOOKUP_PRIOR = 0.5  # a prompt-lookup continuation is the target's this often, until measured


class ProtocolError(Exception):
    """The tail answered something that cannot be the verdict of the frame that was sent."""


class Calibration:
    """P(the target picks a token | the draft proposed it with probability q at rank r), per bin of
    q and rank (first, second, third, the rest), starting from q itself; also for prompt-lookup
    continuations; and the rank histogram of the target's picks among the draft's proposals (the
    last bin: not among them)."""

    def __init__(self, ranks: int = 16) -> None:
        bins = RANK_BINS * CALIBRATION_BINS
        self.hits = [PRIOR_WEIGHT * ((i % CALIBRATION_BINS) + 0.5) / CALIBRATION_BINS for i in range(bins)]
        self.seen = [PRIOR_WEIGHT] * bins
        self.lookup = [LOOKUP_PRIOR * PRIOR_WEIGHT, PRIOR_WEIGHT]
        self.ranks = [0] * (ranks + 1)

    @staticmethod
    def _bin(q: float, rank: int) -> int:
        return min(rank, RANK_BINS - 1) * CALIBRATION_BINS + min(CALIBRATION_BINS - 1, max(0, int(q * CALIBRATION_BINS)))

    def step(self, q: float | None, rank: int = 0) -> float:
        """The calibrated probability of a proposal of draft probability ``q`` at ``rank`` (None: a lookup)."""
        if q is None:
            return self.lookup[0] / self.lookup[1]
        b = self._bin(q, rank)
        return self.hits[b] / self.seen[b]

    def observe(self, proposals: list["Node"], pick: int) -> None:
        """The target picked ``pick`` after a node whose candidates were ``proposals``."""
        rank = len(self.ranks) - 1
        for child in proposals:
            hit = child.token == pick
            if child.q is None:
                self.lookup[0] += hit
                self.lookup[1] += 1
            else:
                b = self._bin(child.q, child.rank)
                self.hits[b] += hit
                self.seen[b] += 1
                if hit:
                    rank = min(rank, child.rank)
        if any(c.q is not None for c in proposals):
            self.ranks[rank] += 1


@dataclass(eq=False)
class Node:
    token: int
    pos: int  # its position in the context
    parent: "Node | None"
    step: float  # calibrated probability that the target picks it after its parent (1 for the root)
    q: float | None = None  # the draft's probability of it (None: a lookup continuation or the root)
    rank: int = 0  # its rank among its parent's proposals
    id: int = 0  # its id once sent; 0: a candidate
    frame: int = 0  # the frame it was sent in
    children: dict[int, "Node"] = field(default_factory=dict)  # by token
    expanded: bool = False
    dead: bool = False
    logv: float = 0.0  # log of the product of the steps since the tree's start: orders nodes for good

    @property
    def sent(self) -> bool:
        return self.id > 0

    def path_to(self, ancestor: "Node | None") -> list["Node"]:
        """This node's ancestors below ``ancestor``, top down, and itself."""
        out, node = [], self
        while node is not ancestor:
            out.append(node)
            node = node.parent
        return out[::-1]


class LiveTree:
    def __init__(self, context: list[int], calibration: Calibration | None = None, root_parent_id: int = 0):
        """A tree after ``context`` (its last token is the root's, not computed by the target yet).

        Two heaps keep the work per frame proportional to what changes, not to the tree: the
        unexpanded nodes whose parents are expanded (``expandable``), and the candidates whose
        parents are sent (``choose``); both ordered by ``logv``, which a move of the root does not
        reorder, and both skip dead entries lazily."""
        self.calibration = calibration or Calibration()
        self.root = Node(context[-1], len(context) - 1, None, 1.0)
        self.root_parent_id = root_parent_id  # the id the root's parent has on the tail (0: the tree's start)
        self.next_id = 1
        self.frames = 0
        self._seq = 0
        self._to_expand: list = []
        self._to_send: list = []
        self._push(self._to_expand, self.root)

    def _push(self, heap: list, node: Node) -> None:
        self._seq += 1
        heapq.heappush(heap, (-node.logv, node.pos, self._seq, node))

    def _new(self, token: int, parent: Node, step: float, q: float | None = None, rank: int = 0) -> Node:
        child = parent.children[token] = Node(token, parent.pos + 1, parent, step, q, rank)
        child.logv = parent.logv + math.log(max(step, 1e-12))
        if parent.sent:
            self._push(self._to_send, child)
        return child

    # -- the live nodes ----------------------------------------------------------------------------
    def value(self, node: Node) -> float:
        """The probability that ``node`` ends on the committed path."""
        return math.exp(node.logv - self.root.logv)

    def nodes(self):
        """Every live node, parents before children."""
        todo = [self.root]
        while todo:
            node = todo.pop()
            yield node
            todo.extend(node.children.values())

    def expected(self, budget: int, max_pos: int) -> tuple[float, int]:
        """The expected yield of one frame of the best ``budget`` live nodes from the root, sent or
        not, none at ``max_pos`` or beyond (the root's own pick included): what a frame per round
        trip would carry from here; and the deepest position among those nodes."""
        heap, ties, total, deepest = [(-self.root.logv, 0, self.root)], itertools.count(1), 0.0, self.root.pos
        while heap and budget > 0:
            node = heapq.heappop(heap)[2]
            total += self.value(node)
            deepest = max(deepest, node.pos)
            budget -= 1
            for child in node.children.values():
                if child.pos < max_pos:
                    heapq.heappush(heap, (-child.logv, next(ties), child))
        return total, deepest

    def expandable(self, width: int) -> list[Node]:
        """Up to ``width`` unexpanded live nodes whose parents are expanded (the draft has the K/V of
        every ancestor), likeliest first. They stay candidates until ``expanded``."""
        out = []
        while self._to_expand and len(out) < width:
            node = heapq.heappop(self._to_expand)[3]
            if not node.dead and not node.expanded:
                out.append(node)
        for node in out:
            self._push(self._to_expand, node)  # back until it is expanded (a step may skip it)
        return out

    def expanded(self, node: Node, proposals: list[tuple[int, float]]) -> None:
        """The draft ran on ``node``; ``proposals``: its continuations (token, probability), ranked."""
        node.expanded = True
        for rank, (token, q) in enumerate(proposals):
            child = node.children.get(token)
            if child is None:
                self._new(token, node, self.calibration.step(q, rank), q, rank)
            elif child.q is None and not child.sent:  # a lookup continuation the draft proposes too
                child.q, child.rank, child.step = q, rank, self.calibration.step(q, rank)
                child.logv = node.logv + math.log(max(child.step, 1e-12))
                if node.sent:
                    self._push(self._to_send, child)
        for child in node.children.values():
            self._push(self._to_expand, child)

    def graft(self, tokens: list[int]) -> None:
        """A continuation found earlier in the context, hung under the root where the tree lacks it."""
        node = self.root
        for token in tokens:
            node = node.children.get(token) or self._new(token, node, self.calibration.step(None))

    # -- a frame -----------------------------------------------------------------------------------
    def choose(self, budget: int, max_pos: int) -> list[Node]:
        """The nodes of the next frame (at most ``budget``, none at ``max_pos`` or beyond), best first,
        parents before children; ``send`` gives them their ids (until then they stay candidates)."""
        chosen: list[Node] = []
        if not self.root.sent:
            if self.root.pos >= max_pos:
                return []
            chosen.append(self.root)
        self._to_send = [e for e in self._to_send if not e[3].dead and not e[3].sent]  # drop stale entries
        heapq.heapify(self._to_send)
        heap = list(self._to_send)
        ties = itertools.count(self._seq + 1)
        for child in (self.root.children.values() if not self.root.sent else ()):
            heap.append((-child.logv, child.pos, next(ties), child))
        heapq.heapify(heap)
        picked = set(chosen)
        while heap and len(chosen) < budget:
            node = heapq.heappop(heap)[3]
            if node.dead or node.sent or node in picked or node.pos >= max_pos:
                continue
            chosen.append(node)
            picked.add(node)
            for child in node.children.values():
                heapq.heappush(heap, (-child.logv, child.pos, next(ties), child))
        return chosen

    def send(self, nodes: list[Node]) -> None:
        """``nodes`` go out in the next frame: each gets the next id."""
        self.frames += 1
        for node in nodes:
            node.id, node.frame = self.next_id, self.frames
            self.next_id += 1
        for node in nodes:
            for child in node.children.values():
                if not child.sent:
                    self._push(self._to_send, child)

    def parent_id(self, node: Node) -> int:
        return node.parent.id if node.parent is not None else self.root_parent_id

    # -- a verdict ---------------------------------------------------------------------------------
    def take(self, frame: list[Node], path: tuple[int, ...], picks: tuple[int, ...], vocab: int
             ) -> tuple[list[int], list[Node]]:
        """Check a frame's verdict and move the root below it: (the committed tokens, the nodes that
        died: every node no longer below the root but the committed ones)."""
        if any(not 0 <= t < vocab for t in picks):
            raise ProtocolError(f"a verdict with a token id outside the vocabulary of {vocab}")
        if len(path) != len(picks) or any(not 0 <= i < len(frame) for i in path):
            raise ProtocolError("a verdict whose path names nodes the frame does not have")
        nodes = [frame[i] for i in path]
        root_here = self.root.sent and any(n is self.root for n in frame)
        if not nodes:
            if root_here:
                raise ProtocolError("an empty verdict for a frame that holds the root, which the target must reach")
            return [], []
        if nodes[0] is not self.root:
            raise ProtocolError("a verdict whose path does not start at the root")
        for above, node, pick in zip(nodes, nodes[1:], picks):
            if node.parent is not above or node.token != pick:
                raise ProtocolError("a verdict whose path does not follow the target's picks down the tree")
        for node, pick in zip(nodes, picks):
            if node.expanded:
                self.calibration.observe(sorted(node.children.values(), key=lambda c: c.rank), pick)
        last, pick = nodes[-1], picks[-1]
        child = last.children.get(pick)
        self.root_parent_id = last.id
        if child is None:
            child = self._new(pick, last, 1.0)
        dead, keep = [], set(nodes)
        todo = [self.root]
        while todo:  # everything below the old root but the committed path and the new root's subtree
            node = todo.pop()
            if node is child:
                continue
            node.dead = True  # committed or not: out of the live tree
            if node not in keep:
                dead.append(node)
            todo.extend(node.children.values())
        child.parent, child.step, child.q = None, 1.0, None
        self.root = child
        if not child.expanded:
            self._push(self._to_expand, child)
        return list(picks), dead
