"""The head's scheduling on a virtual clock: the product's driver and speculator, modelled costs.

Why: the schedule (how many draft steps a frame runs, what grows while a verdict travels, how many
frames are in flight) decides a reply's speed at least as much as any kernel, and trying a
schedule on a GPU costs minutes of a scarce budget. Here the real ``RoundDriver``, ``Speculator``,
``LiveTree``, policy and tail ``Verifier`` run on tiny models on the CPU, every decision the
product makes is the product's, and only the clock is modelled: each draft step, head frame and
tail verify is charged what it costs on the GPU (``--costs``: H200 figures of bench/frame_cost.py
for Qwen2.5-7B/0.5B shapes), the network adds an RTT and a bandwidth, and the host's own Python
time (tree bookkeeping, choosing, encoding) counts as measured on this machine. The figures are
therefore SIMULATED: what the schedule would do at those costs, never a measurement of a GPU.
By default head and tail are two machines, as the product runs them; ``--shared-gpu`` puts them on
one modelled GPU, as `bench/live_bench.py` runs them on one card, to compare with its figures
(RESULTS.md, "the simulator with the bench's one shared GPU").

The draft is ``live_bench.SyntheticDrafter``: after each token it proposes the target's next token
(a fixed permutation) at a rank drawn from a real pair's histogram, the same for every mode.

Run from the repository root:
    python3 bench/pipeline_sim.py [--rtts 30,86,175] [--modes chain,tree,tree-ahead] [--prompts 6]
    python3 bench/pipeline_sim.py --modes stream,auto,auto-4s --policy auto-4s=RETRIAL_SHARE:1
        (auto beside auto with a policy constant changed, in one process: the host's time is measured)
    python3 bench/pipeline_sim.py --rtts 86 --modes tree,stream,auto --rank-seed 3
        (another synthetic text, the same draft quality: each token's proposal at another rank)
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import live_bench  # noqa: E402
import live_report  # noqa: E402
from harness import TINY_DRAFT, TINY_TARGET  # noqa: E402
from sfchat.engine.verifier import Verifier  # noqa: E402
from sfchat.node.tail_loader import TailLoader  # noqa: E402
from sfchat.protocol import wire  # noqa: E402

# H200, bf16, Qwen2.5-7B halves and 0.5B draft (bench/frame_cost.py, RESULTS.md 2026-12-02)
H200 = dict(step_ms=3.9, step_row_ms=0.007, head_ms=4.2, head_row_ms=0.007, hidden_bytes=3584 * 2,
            d2h_gbps=1.0, tail_ms=5.6, tail_row_ms=0.025, seal_gbps=1.5, take_ms=0.0)
# take_ms: the head's time to take a verdict (0: this machine's own Python time for it); live_bench on a
# GPU shows more as "rest" (the syncs behind the K/V moves, the tree's bookkeeping)


class Clock:
    """Virtual time: real time, less the real time of the modelled calls, plus their modelled cost."""

    def __init__(self, gpu: SharedGpu | None = None) -> None:
        self.offset = 0.0
        self.gpu = gpu  # head and tail on one GPU (None: two machines)

    def now(self) -> float:
        return time.perf_counter() + self.offset

    @contextlib.contextmanager
    def charged(self, ms: float, gpu: bool = False):
        """The block costs ``ms`` of virtual time instead of its real time; ``gpu``: it is GPU work,
        stretched by the tail's verifies it meets on a shared GPU."""
        if gpu and self.gpu is not None:
            ms = self.gpu.stretch(self.now(), ms)
        t = time.perf_counter()
        try:
            yield
        finally:
            self.offset += ms / 1e3 - (time.perf_counter() - t)

    def advance(self, to: float) -> None:
        self.offset += max(0.0, to - self.now())

    # the ``time`` module as the driver and the speculator see it
    def perf_counter(self) -> float:
        return self.now()

    monotonic = perf_counter

    def sleep(self, s: float) -> None:
        self.offset += s


class SharedGpu:
    """One GPU under both the head and the tail, as in `bench/live_bench.py` (two processes on one
    card): each tail verify holds it over its modelled interval, and head work (a draft step, a
    head frame) that meets such an interval gets only ``1 - share`` of the GPU while it lasts
    (``share`` 1: the head waits the verify out; 0: two machines, nothing shared). The tail's
    verifies are not slowed in turn (a simplification: the share is fitted to the head's)."""

    def __init__(self, share: float):
        self.share = share
        self.busy: list[tuple[float, float]] = []  # the tail's verifies, (start, end) in clock seconds

    def book(self, start: float, end: float) -> None:
        self.busy.append((start, end))
        self.busy.sort()

    def stretch(self, now: float, ms: float) -> float:
        """The ms head work of ``ms`` on its own takes from ``now``, the verifies it meets included."""
        self.busy = [(a, b) for a, b in self.busy if b > now]
        t, left, speed = now, ms / 1e3, 1.0 - self.share
        for a, b in self.busy:
            if a > t:
                if left <= a - t:
                    break
                left -= a - t
                t = a
            if speed > 0 and left <= (b - t) * speed:
                return (t + left / speed - now) * 1e3
            left -= (b - t) * speed
            t = b
        return (t + left - now) * 1e3


class SimLink:
    """A relay link on the virtual clock: a frame reaches the tail RTT/2 (plus its bytes at the
    link's bandwidth) after it was sent, the tail verifies frames one at a time at the modelled
    cost (none for a frame whose nodes are all dead: the ``Verifier`` answers it without a
    forward), and each verdict comes back RTT/2 later. The verifier runs at once (its answer does
    not depend on time); only its reply's delivery waits."""

    overlaps = True

    def __init__(self, clock: Clock, verifier: Verifier, rtt_ms: float, mbps: float, costs: dict):
        self.clock, self.verifier, self.costs = clock, verifier, costs
        self.half = rtt_ms / 2e3
        self.bytes_s = mbps * 1e6 / 8 if mbps else 0.0
        self.link_free = self.tail_free = 0.0
        self.inbox: list[tuple[float, int, bytes]] = []
        self.seq = 0
        self.last_arrival = None

    def send(self, frame: bytes) -> None:
        now = self.clock.now()
        c = self.costs
        with self.clock.charged(len(frame) / (c["seal_gbps"] * 1e6)):  # sealing and handing it over
            pass
        wire_s = len(frame) / self.bytes_s if self.bytes_s else 0.0
        self.link_free = max(self.link_free, now) + wire_s
        at_tail = self.link_free + self.half
        msg = wire.decode(frame)
        rows = len(msg.tokens) if isinstance(msg, wire.Forward) else 0
        replies = []
        t, computed = time.perf_counter(), self.verifier.computed
        self.verifier.handle(frame, replies.append)
        self.clock.offset -= time.perf_counter() - t  # the tail is another machine
        ran = self.verifier.computed > computed  # a frame all of whose nodes are dead runs no forward
        for raw in replies:
            reply = wire.decode(raw)
            if isinstance(reply, wire.Verdict):
                tail_ms = c["tail_ms"] + c["tail_row_ms"] * rows if ran else 0.0
                start = max(at_tail, self.tail_free)
                self.tail_free = start + tail_ms / 1e3
                if self.clock.gpu is not None:
                    self.clock.gpu.book(start, self.tail_free)
                raw = wire.encode(wire.Verdict(reply.round, reply.tree, reply.path, reply.tokens, int(tail_ms * 1e3)))
                self._deliver(self.tail_free + self.half, raw)
            else:
                self._deliver(at_tail + self.half, raw)

    def _deliver(self, at: float, raw: bytes) -> None:
        self.seq += 1
        heapq.heappush(self.inbox, (at, self.seq, raw))

    def recv(self, timeout: float | None = None) -> bytes:
        if not self.inbox:
            raise TimeoutError
        at, _, raw = self.inbox[0]
        now = self.clock.now()
        if at > now:
            if timeout is not None and now + timeout < at:
                self.clock.advance(now + timeout)
                raise TimeoutError
            self.clock.advance(at)
        heapq.heappop(self.inbox)
        self.last_arrival = at
        return raw

    def close(self) -> None:
        pass


def charge_models(clock: Clock, specs: dict, costs: dict) -> None:
    """Every draft step and head frame costs its modelled GPU time (and the hidden states' copy)."""
    c = costs
    for spec in specs.values():
        d = spec.drafter
        if d is None or getattr(d, "_charged", False):  # no draft (``none``), or charged already
            continue
        d._charged = True
        run = d.graphs.run

        def step(key, fn, inputs, window, _run=run, _d=d):
            with clock.charged(c["step_ms"] + c["step_row_ms"] * _d.rows, gpu=True):
                return _run(key, fn, inputs, window)

        d.graphs.run = step
    for spec in specs.values():
        take = spec.take

        def taken(*args, _take=take, **kw):
            with clock.charged(c["take_ms"]):
                return _take(*args, **kw)

        if c["take_ms"]:
            spec.take = taken
    head = next(iter(specs.values())).head
    run = head.run

    def head_run(ids, *args, _run=run, **kw):
        rows = ids.shape[0]
        ms = c["head_ms"] + c["head_row_ms"] * rows + rows * c["hidden_bytes"] / (c["d2h_gbps"] * 1e6)
        with clock.charged(ms, gpu=True):
            return _run(ids, *args, **kw)

    head.run = head_run


def parser(description: str = __doc__.split("\n")[0]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rtts", default="30,86,175")
    ap.add_argument("--mbps", type=float, default=0.0, help="the link's bandwidth (0: unlimited)")
    ap.add_argument("--modes", default="chain,tree,tree-ahead,stream,auto")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ranks", type=Path, default=Path(__file__).parent / "results" / "pair_ranks.json")
    ap.add_argument("--rank-seed", type=int, default=live_bench.RANK_SEED,
                    help="the synthetic text: the seed of the rank each token's proposal stands at")
    ap.add_argument("--costs", type=json.loads, default={}, help="JSON overrides of the modelled costs")
    ap.add_argument("--shared-gpu", type=float, default=0.0, metavar="SHARE",
                    help="head and tail on one GPU, as live_bench runs them: while a verify runs the head's work "
                         "gets 1 - SHARE of it (0: two machines, the default; 1: it waits the verify out)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SIZE,WIDTH,CHILDREN,INFLIGHT,AHEAD,PLAN",
                    help="a mode of your own: nodes per frame, per draft step, kept per node, frames in flight at "
                         "most, draft steps while a verdict travels, schedules (round, stream, streamN, auto)")
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=CONSTANT:VALUE[,...]",
                    help="a mode of your own: auto with the policy's constants (sfchat.engine.policy) set so, "
                         "e.g. auto-4s=RETRIAL_SHARE:1 (restored after the mode)")
    return ap


def policy_modes(specs: list[str]) -> dict[str, dict[str, float]]:
    """``--policy`` values as {mode: {constant: value}}, each constant one the policy has."""
    from sfchat.engine import policy

    out = {}
    for spec in specs:
        name, _, sets = spec.partition("=")
        try:
            pairs = [kv.split(":") for kv in sets.split(",")]
            out[name] = {k: type(getattr(policy, k))(float(v)) for k, v in pairs}
        except (ValueError, AttributeError, TypeError):
            raise SystemExit(f"--policy {spec!r}: give NAME=CONSTANT:VALUE[,...], constants of sfchat.engine.policy")
    return out


@contextlib.contextmanager
def with_policy(sets: dict[str, float]):
    """The policy module's constants set to ``sets`` for the block, restored after."""
    from sfchat.engine import policy

    old = {k: getattr(policy, k) for k in sets}
    try:
        for k, v in sets.items():
            setattr(policy, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(policy, k, v)


def simulate(args, prepare=lambda mode, spec: contextlib.nullcontext()) -> tuple[dict, dict]:
    """Every mode of ``args.modes`` at every RTT of ``args.rtts`` on the virtual clock: (live_bench's
    result per (mode, rtt), the speculator of each mode). ``prepare(mode, spec)``: a context the
    mode's run goes through (a variant's changes to the product, undone after it)."""
    if not 0.0 <= args.shared_gpu <= 1.0:
        raise SystemExit("--shared-gpu takes a share in 0..1")
    for v in args.variant:
        name, _, spec = v.partition("=")
        *mode, plan = spec.split(",")
        live_bench.MODES[name] = (*(int(x) for x in mode), plan)
    policies = policy_modes(args.policy)
    for name in policies:
        live_bench.MODES[name] = live_bench.MODES["auto"]
    costs = H200 | args.costs
    live_bench.RANK_SEED = args.rank_seed
    harness.DEVICE = "cpu"
    root = Path(tempfile.mkdtemp(prefix="sfchat-sim-"))
    vocab = TINY_DRAFT["vocab_size"]
    harness.write_checkpoint(root / "target", TINY_TARGET, seed=0, follows=vocab)
    harness.write_checkpoint(root / "draft", TINY_DRAFT, seed=1)
    ranks = json.loads(args.ranks.read_text())
    synthetic = (torch.randperm(vocab, generator=torch.Generator().manual_seed(1234)), ranks)
    specs, hello = live_bench.build(root / "target", root / "draft", "cpu", "float32", synthetic,
                                    modes=tuple(args.modes.split(",")))
    prompts = live_bench.prompts_for(root / "target", True, args.prompts)
    prompts = [[t % vocab for t in p] for p in prompts]
    clock = Clock(SharedGpu(args.shared_gpu) if args.shared_gpu else None)
    charge_models(clock, specs, costs)
    import sfchat.engine.speculator as speculator_mod
    import sfchat.node.driver as driver_mod

    speculator_mod.time = driver_mod.time = live_bench.time = clock
    rtts = [float(x) for x in args.rtts.split(",")]
    modes = args.modes.split(",")
    res = {}
    for rtt in rtts:
        for mode in modes:
            verifier = Verifier(TailLoader(torch.device("cpu")))
            link = SimLink(clock, verifier, rtt, args.mbps, costs)
            with prepare(mode, specs[mode]), with_policy(policies.get(mode, {})):
                res[(mode, rtt)] = r = live_bench.run_mode(specs[mode], *live_bench.MODES[mode][3:], link, hello,
                                                           prompts, args.new)
            print(f"rtt {rtt:g} {mode}: " + live_report.row(r, None, rtt) + f" verdicts that committed nothing: "
                  f"{r['empty']:.1%}", file=sys.stderr, flush=True)
    return res, specs


def main() -> None:
    args = parser().parse_args()
    res, specs = simulate(args)
    rtts, modes, costs = [float(x) for x in args.rtts.split(",")], args.modes.split(","), H200 | args.costs
    print(f"SIMULATED on a virtual clock (bench/pipeline_sim.py), costs {costs}, {args.mbps or 'unlimited'} Mbit/s"
          + (f", head and tail on one GPU (share {args.shared_gpu:g})" if args.shared_gpu else ", two machines"))
    live_report.print_table(res, rtts, modes, specs[modes[-1]].calibration.ranks)


if __name__ == "__main__":
    main()
