"""What hedging would add to the streamed schedule, predicted on the simulator (bench/pipeline_sim.py).

A frame built while others are in flight bets on their verdicts. The live tree already spreads a
frame's nodes over every pending verdict's outcomes by their value (the probability that a node
ends on the committed path: accept lengths x bonus tokens, the draft's alternatives included), so
the question is whether betting MORE on the outcomes pays. The variants, each the product's
stream schedule with one change (run one after another in one process, the same prompts and
rank histogram):

* ``stream``: the product as it is;
* ``stream-hedgeB``: a frame ranks the candidates whose parent is in flight (each a possible
  pick of a pending verdict, so a possible new root) as if B times likelier, so more of the
  outcomes of the verdicts in flight have their continuation sent before the verdict is known;
* ``stream-altB``: the same for the draft's alternatives alone (not its first choice): the bonus
  tokens of a rejection, whose continuations are what a rejection would otherwise void;
* ``stream-wideB``: the draft's alternatives valued B times likelier everywhere (at most 1 a
  step): expanded, sent and weighed against a frame's cut alike, so the draft's steps too go to
  the outcomes of rejections;
* ``stream-free``: a frame every node of which a verdict killed leaves the count of frames in
  flight at once (the tail answers it without a forward; its verdict is ignored as stale), so
  the head sends a live frame in its place instead of waiting for that verdict.

Figures are SIMULATED (modelled GPU costs, this machine's Python time); read the yield per
verdict beside the tok/s: a hedge that pays commits more per frame.

Run from the repository root:
    python3 bench/hedge_sim.py [--rtts 86,175] [--boosts 3,10] [--kinds hedge,alt,wide,free] [--prompts 4]
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import live_bench  # noqa: E402
import pipeline_sim  # noqa: E402
from sfchat.engine.live import LiveTree  # noqa: E402
from sfchat.node.driver import RoundDriver  # noqa: E402


def hedged_choose(tree: LiveTree, budget: int, max_pos: int, boost: float, alternatives: bool = False) -> list:
    """``LiveTree.choose`` with the candidates under nodes in flight ranked ``boost`` times likelier
    (``alternatives``: only those that are not the draft's first choice: the bonus tokens of a rejection)."""
    lift = math.log(boost)
    order = itertools.count()

    def entry(node):
        pending = node.parent is not None and node.parent.sent and (node.rank > 0 or not alternatives)
        return -(node.logv + (lift if pending else 0.0)), node.pos, next(order), node

    chosen, root = [], tree.root
    if not root.sent:
        if root.pos >= max_pos:
            return []
        chosen.append(root)
    frontier = [entry(n) for n in tree.nodes() if not n.sent and n is not root and (n.parent is root or n.parent.sent)]
    heapq.heapify(frontier)
    while frontier and len(chosen) < budget:
        node = heapq.heappop(frontier)[3]
        if node.pos >= max_pos:
            continue
        chosen.append(node)
        for child in node.children.values():
            heapq.heappush(frontier, entry(child))
    return chosen


@contextlib.contextmanager
def hedged(spec, boost: float, alternatives: bool):
    """Every tree ``spec`` opens chooses its frames with ``hedged_choose``."""
    opened = spec._open

    def _open():
        opened()
        spec.live.choose = lambda budget, max_pos: hedged_choose(spec.live, budget, max_pos, boost, alternatives)

    spec._open = _open
    try:
        yield
    finally:
        del spec._open


@contextlib.contextmanager
def widened(spec, boost: float):
    """``spec``'s calibration values the draft's alternatives ``boost`` times higher (its
    measurements stay as they are)."""
    step = spec.calibration.step
    spec.calibration.step = lambda q, rank=0: min(1.0, step(q, rank) * (boost if rank > 0 else 1.0))
    try:
        yield
    finally:
        del spec.calibration.step


@contextlib.contextmanager
def voids_freed():
    """After each verdict, frames whose nodes are all dead leave the driver's frames in flight."""
    original = RoundDriver._round

    def _round(self, *args, **kw):
        out = original(self, *args, **kw)
        self.flight = deque(f for f in self.flight if not all(n.dead for n in f.nodes))
        return out

    RoundDriver._round = _round
    try:
        yield
    finally:
        RoundDriver._round = original


def main(argv: list[str] | None = None) -> None:
    ap = pipeline_sim.parser(__doc__.split("\n")[0])
    ap.add_argument("--boosts", default="3,10", help="the hedged variants' factors")
    ap.add_argument("--kinds", default="hedge,alt,wide,free", help="the variants to run beside the product's stream")
    ap.set_defaults(rtts="86,175", prompts=4)
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - {"hedge", "alt", "wide", "free"}:
        ap.error("--kinds takes hedge, alt, wide and free")
    boosts = {f"stream-{kind}{b}": (kind, float(b)) for kind in kinds if kind != "free"
              for b in args.boosts.split(",") if b}
    if any(b < 1 for _, b in boosts.values()):
        ap.error("--boosts are factors of at least 1")
    variants = [*boosts] + (["stream-free"] if "free" in kinds else [])
    for name in variants:
        live_bench.MODES[name] = live_bench.MODES["stream"]
    args.modes = ",".join(("stream", *variants))

    def prepare(mode, spec):
        if mode == "stream-free":
            return voids_freed()
        if mode not in boosts:
            return contextlib.nullcontext()
        kind, boost = boosts[mode]
        return widened(spec, boost) if kind == "wide" else hedged(spec, boost, kind == "alt")

    res, _ = pipeline_sim.simulate(args, prepare)
    print(f"SIMULATED (bench/hedge_sim.py), costs {pipeline_sim.H200 | args.costs}, "
          + (f"one shared GPU (share {args.shared_gpu:g})" if args.shared_gpu else "two machines")
          + f", {args.prompts} prompts x {args.new}\n")
    print("| RTT ms | variant | tok/s | vs stream | tokens/verdict (predicted) | verdicts that committed nothing | in flight |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rtt in (float(x) for x in args.rtts.split(",")):
        base = res[("stream", rtt)]["tps"]
        for mode in args.modes.split(","):
            r = res[(mode, rtt)]
            print(f"| {rtt:g} | {mode} | {r['tps']:.1f} | {r['tps'] / base:.2f}x | {r['tokens_per_verdict']:.2f} "
                  f"({r['expected']:.2f}) | {r['empty']:.1%} | {r['in_flight']:.2f} |")
    replies = [r["ids"] for r in res.values()]
    same = sum(all(ids[i] == replies[0][i] for ids in replies) for i in range(len(replies[0])))
    print(f"\nreplies identical across every variant and RTT: {same} of {len(replies[0])}")


if __name__ == "__main__":
    main()
