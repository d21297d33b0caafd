"""How deep to draft, how large a tree, how many frames in flight: chosen from measured rounds.

Contract
--------
``menu(k, tree_budget, adaptive)`` is the set of round shapes a head may use (``Shape``: a chain
of ``depth`` drafts, depth 0 meaning none, or a tree of ``budget`` nodes at most ``depth`` deep).
Fixed settings give one shape; ``--k auto`` gives chains of 0, 2, 4 and K drafts, and
``--tree-budget`` the tree: each is captured as graphs up front, on the tail too.

``SpeculationPolicy(shapes, max_in_flight)`` learns from every verdict (``observe``) and answers
``choose() -> (shape, frames in flight)`` to maximise expected tokens per second, all measured,
none guessed:

* the link: the verdict's latency less the tail's compute, fitted as ``base + bytes x cost``
  over the rounds (a large frame shows what the link's throughput is);
* compute: the head's draft and head-slice time of each shape, the tail's, and the head's own
  overhead per verdict (taking it, frames, the link: its busy time less that compute);
* acceptance per depth: for each depth d, the share of rounds that reached d - 1 accepted drafts
  and were offered a d-th whose d-th was accepted (so a chain of any depth is predicted from
  rounds of deeper ones); for a tree, its tokens per round; for both, how often the likeliest
  path was accepted to its end, and how often the draft's guess of the bonus after it was right.

A round commits ``E`` tokens in ``T`` = compute + overhead + base + bytes x cost + tail. With ``m``
frames in flight the next frame assumes the likeliest outcome, which holds with probability ``h``
(every draft on the likeliest path accepted, and the guess right); a hit keeps the pipeline
going, one verdict every ``max(compute + overhead, tail, T / m, link time)`` (the head, the tail
and the link each serve one frame at a time); a miss restarts it (``T``, plus the dropped frames
still on the wire). So ``rate = E / (h x spacing + (1 - h) x (T + waste))``, and the
smallest ``m`` within 2 % of the best is chosen. Shapes never measured are tried first (the
deepest first: its rounds teach every depth's acceptance), and every ``EXPLORE_EVERY`` rounds
the least recently used shape runs once, so that estimates of shapes not chosen stay current.
Torch-free; knows nothing about models or links.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.2  # of the newest round in every running estimate
GUESS_PRIOR = 0.8  # the draft's guess of the bonus is the target's this often, until measured
ACCEPT_PRIOR = 0.5  # acceptance at a depth no round has reached yet
EXPLORE_EVERY = 24  # rounds between two runs of the least recently used shape
AUTO_DEPTHS = (0, 2, 4)  # chain depths below K that --k auto also captures


@dataclass(frozen=True, order=True)
class Shape:
    depth: int  # drafts of a chain (0: none), or the deepest a tree may grow
    budget: int = 0  # nodes of a tree; 0: a chain

    def __str__(self) -> str:
        return f"tree {self.budget}, depth {self.depth}" if self.budget else f"chain {self.depth}"


def menu(k: int, tree_budget: int, auto_depth: bool = False, auto_tree: bool = False) -> list[Shape]:
    """The shapes rounds may take: chains of ``k`` drafts (with ``auto_depth`` also of 0, 2 and 4),
    and a tree of ``tree_budget`` nodes when there is one (beside the chain of ``k`` when the
    budget is ``auto_tree``'s; alone when it was fixed and the depth too)."""
    if k == 0:
        return [Shape(0)]
    if auto_depth:
        chains = sorted({d for d in AUTO_DEPTHS if d < k} | {k})
    else:
        chains = [] if tree_budget and not auto_tree else [k]
    return [Shape(d) for d in chains] + ([Shape(k, tree_budget)] if tree_budget else [])


def chain_depths(shapes: list[Shape]) -> tuple[int, ...]:
    return tuple(sorted({s.depth for s in shapes if not s.budget}))


class SpeculationPolicy:
    def __init__(self, shapes: list[Shape], max_in_flight: int = 1):
        self.shapes = sorted(shapes, key=lambda s: (-s.depth, -s.budget))
        self.max_in_flight = max(1, max_in_flight) if any(s.depth for s in shapes) else 1
        self.compute: dict[Shape, float] = {}  # draft + head ms of a round planned from scratch
        self.tail: dict[Shape, float] = {}
        self.bytes: dict[Shape, float] = {}
        self.tokens: dict[Shape, float] = {}  # trees: tokens per round
        self.full: dict[Shape, float] = {}  # trees: the likeliest path accepted to its end
        self.last_used: dict[Shape, int] = {}
        self.accept: list[float | None] = [None] * (max(s.depth for s in shapes) + 1)  # index d: P(d-th | d-1)
        self.guess = GUESS_PRIOR
        self.overhead = 0.0  # head ms per verdict beyond drafting and the head slice
        self.rounds = 0
        self._x = self._y = self._xx = self._xy = None  # link fit: bytes, latency ms
        self.base_ms, self.ms_per_byte = 0.0, 0.0

    # -- learning ------------------------------------------------------------------------------
    def observe(self, shape: Shape, *, accepted: int, full: bool, sent_bytes: int, rtt_ms: float, tail_ms: float,
                compute_ms: float | None = None, guess_right: bool | None = None,
                overhead_ms: float | None = None) -> None:
        """One verdict: of a round of ``shape`` that accepted ``accepted`` drafts (``full``: its
        likeliest path to the end), sent ``sent_bytes``, came back ``rtt_ms`` after sending
        (the tail's ``tail_ms`` excluded); ``compute_ms`` of a steady round (no prefill, no catch-up);
        ``guess_right`` when a frame in flight assumed its bonus and every draft was accepted."""
        self.rounds += 1
        self.last_used[shape] = self.rounds
        self.tail[shape] = _ema(self.tail.get(shape), tail_ms)
        self.bytes[shape] = _ema(self.bytes.get(shape), float(sent_bytes))
        if compute_ms is not None:
            self.compute[shape] = _ema(self.compute.get(shape), compute_ms)
        if shape.budget:
            self.tokens[shape] = _ema(self.tokens.get(shape), accepted + 1.0)
            self.full[shape] = _ema(self.full.get(shape), float(full))
        else:
            for d in range(1, min(accepted + 1, shape.depth) + 1):  # offered a d-th after d - 1 accepted
                self.accept[d] = _ema(self.accept[d], float(accepted >= d))
        if guess_right is not None:
            self.guess = _ema(self.guess, float(guess_right))
        if overhead_ms is not None:
            self.overhead = _ema(self.overhead, max(0.0, overhead_ms))
        self._fit(float(sent_bytes), rtt_ms)

    def _fit(self, x: float, y: float) -> None:
        self._x, self._y = _ema(self._x, x), _ema(self._y, y)
        self._xx, self._xy = _ema(self._xx, x * x), _ema(self._xy, x * y)
        var = self._xx - self._x ** 2
        if var > (0.05 * self._x) ** 2 + 1.0:  # sizes that differ enough to tell bandwidth from latency
            self.ms_per_byte = max(0.0, (self._xy - self._x * self._y) / var)
        self.base_ms = max(0.0, self._y - self.ms_per_byte * self._x)

    # -- prediction ----------------------------------------------------------------------------
    def reach(self, depth: int) -> list[float]:
        """P(at least d drafts accepted) of a chain, for d = 0..depth."""
        out = [1.0]
        for d in range(1, depth + 1):
            a = self.accept[d] if self.accept[d] is not None else ACCEPT_PRIOR
            out.append(out[-1] * a)
        return out

    def expected(self, shape: Shape) -> tuple[float, float]:
        """(tokens a round commits, probability that its likeliest outcome is the real one). The
        bonus after a chain of d accepted drafts is the draft's guess of the (d+1)-th: right as often
        as a (d+1)-th draft is accepted, where deeper chains measured that; the guess rate
        measured on rounds in flight otherwise (and for trees)."""
        reach = self.reach(shape.depth)
        tokens, full = sum(reach), reach[-1]
        if shape.budget:
            return self.tokens.get(shape, tokens), self.full.get(shape, full) * self.guess
        nxt = self.accept[shape.depth + 1] if shape.depth + 1 < len(self.accept) else None
        return tokens, full * (self.guess if nxt is None else nxt)

    def rate(self, shape: Shape, m: int) -> float:
        """Expected tokens per ms of ``shape`` with up to ``m`` frames in flight."""
        tokens, hit = self.expected(shape)
        compute = self._compute(shape) + self.overhead
        link = self.bytes.get(shape, 0.0) * self.ms_per_byte
        tail = self._tail(shape)
        t = compute + self.base_ms + link + tail
        if m == 1 or shape.depth == 0 and not hit:
            return tokens / max(t, 1e-3)
        spacing = max(compute, tail, t / m, link * (1 + (1 - hit) * (m - 1)))
        return tokens / max(hit * spacing + (1 - hit) * (t + (m - 1) * link), 1e-3)

    def _compute(self, shape: Shape) -> float:
        if shape in self.compute:
            return self.compute[shape]
        known = [(s.depth, ms) for s, ms in self.compute.items() if not s.budget]
        if not known:
            return 0.0
        d, ms = max(known)  # a draft's cost is about linear in depth
        return ms * (shape.depth + 1) / (d + 1)

    def _tail(self, shape: Shape) -> float:
        return self.tail.get(shape, min(self.tail.values(), default=0.0))

    # -- the choice ----------------------------------------------------------------------------
    def choose(self) -> tuple[Shape, int]:
        untried = [s for s in self.shapes if s not in self.compute]
        if untried:
            return untried[0], 1
        if self.rounds and self.rounds % EXPLORE_EVERY == 0:
            return min(self.shapes, key=lambda s: self.last_used.get(s, 0)), 1
        best, best_rate = self.shapes[0], -1.0
        for shape in self.shapes:
            r = self.rate(shape, self.max_in_flight)
            if r > best_rate * 1.02:
                best, best_rate = shape, r
        top = self.rate(best, self.max_in_flight)
        m = next(m for m in range(1, self.max_in_flight + 1) if self.rate(best, m) >= 0.98 * top)
        return best, m


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
