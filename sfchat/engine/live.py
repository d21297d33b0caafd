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
* ``choose(budget)``: the frame: the root if it was not sent yet, then the likeliest candidates
  whose parents are sent or chosen, best first (a path's value never rises, so the best nodes'
  ancestors are among them); ``send(nodes)`` gives each the next id.
* ``take(frame, verdict)``: the verdict of one frame, checked (``ProtocolError`` for anything the
  frame cannot have produced): its path must start at the root, if the root was in that frame, and
  go down the frame's nodes, each the target's pick at the one before. Returns the committed
  tokens; the root moves to the child of the last committed node whose token is the last pick
  (a live node when one was sent or proposed, else a new one), and every node not below it is
  dead. ``take`` feeds the calibration with each committed node's proposals.

The tree owns no memory: each node carries the KV slot it holds in the draft's and the head
slice's scratch (``draft_slot``, ``head_slot``), which the round assigns, moves and frees (see
``SlotPool``). No models, no wire, no I/O.
"""

from __future__ import annotations

import heapq
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
    draft_slot: int | None = None
    head_slot: int | None = None
    value: float = 0.0

    @property
    def sent(self) -> bool:
        return self.id > 0

    def path_to(self, ancestor: "Node") -> list["Node"]:
        """This node's ancestors below ``ancestor``, top down, and itself."""
        out, node = [], self
        while node is not ancestor:
            out.append(node)
            node = node.parent
        return out[::-1]


class LiveTree:
    def __init__(self, context: list[int], calibration: Calibration | None = None, root_parent_id: int = 0):
        """A tree after ``context`` (its last token is the root's, not computed by the target yet)."""
        self.calibration = calibration or Calibration()
        self.root = Node(context[-1], len(context) - 1, None, 1.0, value=1.0)
        self.root_parent_id = root_parent_id  # the id the root's parent has on the tail (0: the tree's start)
        self.next_id = 1
        self.frames = 0

    # -- the live nodes ----------------------------------------------------------------------------
    def nodes(self):
        """Every live node, parents before children, with its value brought up to date."""
        self.root.value = 1.0
        todo = [self.root]
        while todo:
            node = todo.pop()
            yield node
            for child in node.children.values():
                child.value = node.value * child.step
                todo.append(child)

    def expandable(self, width: int) -> list[Node]:
        """Up to ``width`` unexpanded live nodes whose parents are expanded (the draft has the K/V of
        every ancestor), likeliest first."""
        nodes = [n for n in self.nodes() if not n.expanded and (n.parent is None or n.parent.expanded)]
        return sorted(nodes, key=lambda n: (-n.value, n.pos))[:width]

    def expanded(self, node: Node, proposals: list[tuple[int, float]]) -> None:
        """The draft ran on ``node``; ``proposals``: its continuations (token, probability), ranked."""
        node.expanded = True
        for rank, (token, q) in enumerate(proposals):
            child = node.children.get(token)
            if child is None:
                node.children[token] = Node(token, node.pos + 1, node, self.calibration.step(q, rank), q, rank)
            elif child.q is None:  # a lookup continuation the draft proposes too: the draft's estimate
                child.q, child.rank, child.step = q, rank, self.calibration.step(q, rank)

    def graft(self, tokens: list[int]) -> None:
        """A continuation found earlier in the context, hung under the root where the tree lacks it."""
        node = self.root
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node(token, node.pos + 1, node, self.calibration.step(None))
            node = child

    # -- a frame -----------------------------------------------------------------------------------
    def choose(self, budget: int, max_pos: int) -> list[Node]:
        """The nodes of the next frame (at most ``budget``, none at ``max_pos`` or beyond), best first,
        parents before children; ``send`` gives them their ids."""
        chosen: list[Node] = []
        order = {id(n): i for i, n in enumerate(self.nodes())}  # values up to date; a stable tie order
        heap: list[tuple[float, int, int, Node]] = []

        def offer(node: Node) -> None:
            for child in node.children.values():
                if not child.sent and child.pos < max_pos:
                    heapq.heappush(heap, (-child.value, child.pos, order[id(child)], child))
                elif child.sent:
                    offer(child)

        if not self.root.sent:
            if self.root.pos >= max_pos:
                return []
            chosen.append(self.root)
        offer(self.root)
        while heap and len(chosen) < budget:
            node = heapq.heappop(heap)[3]
            chosen.append(node)
            offer(node)
        return chosen

    def send(self, nodes: list[Node]) -> None:
        """``nodes`` go out in the next frame: each gets the next id."""
        self.frames += 1
        for node in nodes:
            node.id, node.frame = self.next_id, self.frames
            self.next_id += 1

    def parent_id(self, node: Node) -> int:
        return node.parent.id if node.parent is not None else self.root_parent_id

    # -- a verdict ---------------------------------------------------------------------------------
    def take(self, frame: list[Node], path: tuple[int, ...], picks: tuple[int, ...], vocab: int) -> list[int]:
        """Check a frame's verdict and move the root below it; the committed tokens (the picks)."""
        if any(not 0 <= t < vocab for t in picks):
            raise ProtocolError(f"a verdict with a token id outside the vocabulary of {vocab}")
        if len(path) != len(picks) or any(not 0 <= i < len(frame) for i in path):
            raise ProtocolError("a verdict whose path names nodes the frame does not have")
        nodes = [frame[i] for i in path]
        root_here = self.root.sent and self.root in frame
        if not nodes:
            if root_here:
                raise ProtocolError("an empty verdict for a frame that holds the root, which the target must reach")
            return []
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
            child = Node(pick, last.pos + 1, last, 1.0)
        child.parent, child.step, child.q = None, 1.0, None
        self.root = child
        return list(picks)

class SlotPool:
    """Scratch KV slots for live nodes, right after a cache's context: slots ``[n, n + size - 1)``,
    the last one kept as the trash slot that padding rows write to. ``commit`` moves the context's
    end over the committed nodes and relocates the live ones the context now covers."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size
        self.used: set[int] = set()

    @property
    def trash(self) -> int:
        return self.n + self.size - 1

    @property
    def free(self) -> int:
        return self.size - 1 - len(self.used)

    def take(self) -> int | None:
        for slot in range(self.n, self.n + self.size - 1):
            if slot not in self.used:
                self.used.add(slot)
                return slot
        return None

    def release(self, slot: int | None) -> None:
        self.used.discard(slot)

    def reset(self, n: int) -> None:
        self.n, self.used = n, set()

    def commit(self, slots: list[int]) -> tuple[list[int], list[int], dict[int, int]]:
        """The committed nodes' slots, in order, become the context's next slots. Returns the moves
        (sources, destinations: sources all read before any write) and where each live slot went."""
        n = self.n + len(slots)
        live = self.used - set(slots)
        displaced = sorted(s for s in live if s < n)
        spare = (s for s in range(n, n + self.size - 1) if s not in live)
        moved = {s: next(spare) for s in displaced}
        src = list(slots) + displaced
        dst = list(range(self.n, n)) + [moved[s] for s in displaced]
        self.used = (live - set(displaced)) | set(moved.values())
        self.n = n
        return src, dst, moved
