"""The live speculation tree against one round per round trip, through a real relay, whole replies.

For each emulated RTT a real sfchat-relay on loopback and a tail process (sealed end to end, as
relay mode is by default) serve one head process, which loads its models once and answers the
same prompts in every mode, each reply timed whole (prefill included), EOS ignored:

  * ``chain``: a chain of 8 drafts per frame, one frame per round trip (the baseline);
  * ``tree``: 64 drafts per frame, best first over the tree, one frame per round trip, each frame
    running its own draft steps (the policy's ``ROUND`` schedule); ``tree-ahead``: the same, with
    the draft expanding the live tree's likeliest nodes while a verdict travels (up to 16 steps
    per wait: ``RoundDriver(ahead_steps=)``);
  * ``stream``: frames of at most 2 draft steps of their own, as many in flight as the timing asks
    (up to 8), each taking the best unsent nodes of the live tree (the policy's ``STREAM`` schedule);
  * ``auto``: the product's default: the policy measures both schedules and follows the faster;
  * ``none``: no draft, one token per round trip (the target's own output on this GPU).

``--frame-rows N`` (default 64, the product's on a GPU; 0: off) runs every forward of the target,
on head and tail, at N rows: frames padded, the prompt in pieces of N; ``--compile-attention``
runs their canonical attention compiled (``sfchat --compile-attention``: the head's, its hello tells the tail);
``--compile-frames`` their whole forwards (``sfchat --compile-frames``, likewise);
``--compile-draft`` compiles the draft's step for each window, as sfchat does by default (off: plain, graphed);
``--tail-logs DIR`` keeps each tail's output; ``--no-settle`` leaves the head's heap unfrozen
after loading (the product settles it: ``sfchat.node.heap``; the head's full collections in each
mode, their count and ms, go to stderr and ``--save``). ``--temperature T``
(default 0: greedy) samples every reply at T, seeded by ``--seed`` (each prompt's reply drawn from
the same per-position random stream in every mode, so a mode that computes the target's
probabilities alike gives the same text).

Models:

  * ``--pair DIR``: a real pair: the target in DIR (SmolLM2-135M-Instruct, ``sfchat-model
    smollm2``) and as draft its copy with the decoder layers' linear weights rounded to 4 bits per
    group of 64 (``tree_accept.quantised_copy``); 12 prompts of 4 kinds (tree_accept.PROMPTS).
    The rank histogram of the target's picks among the draft's proposals is printed and saved
    (``--ranks-out``): the synthetic draft below uses it.
  * otherwise synthetic: bf16 checkpoints in the shapes of Qwen2.5-7B (target) and 0.5B (draft).
    The target's greedy next token is a fixed permutation of the current one
    (``harness.write_checkpoint(follows=)``); the draft runs a random 0.5B (its compute is
    real) but proposes, after each token, a ranked list in which the target's token sits at a rank
    drawn once per token from ``--ranks`` (a real pair's histogram), the other places decoys:
    alternatives that carry information as a real draft's do.
  * ``--self SHAPE`` (``0.5b``, ``1.5b`` or ``7b``): a random bf16 checkpoint in that shape drafts
    for itself (its own draft numerics: deep trees); a random model's picks sit near ties, so any
    drift in the target's arithmetic shows in its replies (the identity check's hardest case).

The table: tok/s and the tokens committed per round trip of the network (tok/s x RTT), tokens
per verdict (and what the tree's values predicted a frame would commit: the nodes on the committed
path against the expectation), frames in flight, and where a verdict's time went (draft, head
slice and frame, the tail's compute, the network, the rest on the head), the draft steps per
verdict of the frames' own builds and of the steps run ahead, a steady frame's build and the
verdicts under each schedule; the token ids of every reply are compared across modes and RTTs
(``identical``). Under ``auto``, the policy's choices (after which verdict, on which measured
rates and forecasts) go to stderr and into ``--save``'s JSON (``decisions``).

Run from the repository root:
    python3 bench/live_bench.py --pair DIR [--rtts 0,30,86,175] [--new 128] [--save out.json]
    python3 bench/live_bench.py --ranks ranks.json [--rtts 0,30,86,175]
    python3 bench/live_bench.py --smoke   (tiny shapes on the CPU: checks the script, measures nothing)
    python3 bench/live_bench.py --self tiny --device cpu --k 4 --rtts 200 --new 160 --modes tree,stream,auto
        (a tiny random model drafting for itself on the CPU: every draft accepted; head and tail share the cores)
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
from live_report import modes_at, print_table, row, save, verdict_rows  # noqa: E402
from harness import QWEN25_05B, QWEN25_15B, QWEN25_7B, TINY_DRAFT, TINY_TARGET, head_link, relay_and_tail  # noqa: E402
from sfchat.engine.draft import WIDTH, Drafter  # noqa: E402
from sfchat.engine.live import LiveTree  # noqa: E402
from sfchat.engine.policy import ROUND, SCHEDULES, STREAM, PipelinePolicy, Schedule  # noqa: E402
from sfchat.engine.speculator import Speculator  # noqa: E402
from sfchat.model import attention  # noqa: E402
from sfchat.model.decoder import n_layers  # noqa: E402
from sfchat.model.devices import DTYPE_NAMES, DTYPES  # noqa: E402
from sfchat.model.kv import draft_slots  # noqa: E402
from sfchat.model.slices import ModelSlice  # noqa: E402
from sfchat.model.source import ModelSource  # noqa: E402
from sfchat.node import heap  # noqa: E402
from sfchat.node.driver import RoundDriver  # noqa: E402
from sfchat.protocol.handshake import Hello  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

K = 8
MAX_CONTEXT = 2048
GREEDY = Sampling()
AHEAD = 16
IN_FLIGHT = 8  # the product's default --max-in-flight
# name: (nodes per frame, nodes the draft expands per step, continuations kept per node, frames in flight at most,
#        draft steps while a verdict travels, the policy's schedules: "round", "stream", "auto" = both, "streamN":
#        streamed frames of at most N draft steps of their own)
W = WIDTH  # the product's: a step expands 8 nodes
MODES = {"chain": (K + 1, 1, 1, 1, 0, "round"), "tree": (64, W, 8, 1, 0, "round"),
         "tree-ahead": (64, W, 8, 1, AHEAD, "round"), "stream": (64, W, 8, IN_FLIGHT, 0, "stream"),
         "auto": (64, W, 8, IN_FLIGHT, 0, "auto"), "none": (1, 1, 1, 1, 0, "round")}


SELF_SHAPES = {"tiny": TINY_TARGET, "0.5b": QWEN25_05B, "1.5b": QWEN25_15B, "7b": QWEN25_7B}


def schedules(name: str) -> tuple[Schedule, ...]:
    if name == "auto":
        return SCHEDULES  # the product's, in its order
    if name.startswith("stream") and name[6:]:
        return (Schedule(name, int(name[6:]), None),)
    return {"round": (ROUND,), "stream": (STREAM,)}[name]


FIELDS = ("draft_ms", "head_ms", "tail_ms", "rtt_ms", "wait_ms", "overlap_ms", "round_ms", "draft_steps", "ahead_steps",
          "expected")


RANK_SEED = 7  # the synthetic text: which rank each token's proposal stands at (pipeline_sim --rank-seed)


def draw_ranks(ranks: list[int], n: int, seed: int = RANK_SEED) -> list[int]:
    """For each of ``n`` tokens, the rank at which the draft proposes the target's next token, drawn
    from the whole histogram ``ranks`` (the last entry: not proposed at all), the same for every
    mode: a rank at or past a frame's width means that mode's draft does not propose it."""
    rng = random.Random(seed)
    return [rng.choices(range(len(ranks)), ranks)[0] for _ in range(n)]


def synthetic_proposals(token: int, perm: list[int], rank: list[int], q: list[float], children: int
                        ) -> list[tuple[int, float]]:
    """The ``children`` proposals after ``token``: the target's next token ``perm[token]`` at its
    drawn rank when that rank is below ``children``, decoys elsewhere; confidences ``q`` per rank."""
    true = perm[token] if token < len(perm) else 0
    at = rank[token] if token < len(perm) else children
    seed = random.Random(token * 7919 + 1)
    props = [seed.randrange(len(perm)) for _ in range(children)]
    props = [p if p != true else (p + 1) % len(perm) for p in props]
    if at < children:
        props[at] = true
    return list(zip(props, q))


class SyntheticDrafter(Drafter):
    """A draft whose proposals after token t put the target's next token perm[t] at a rank drawn
    once per t from a real pair's rank histogram (``draw_ranks``); the model still runs, so the
    cost is real."""

    def __init__(self, *args, perm: torch.Tensor, ranks: list[int], **kw):
        super().__init__(*args, **kw)
        self.perm = perm.tolist()
        self.rank = draw_ranks(ranks, len(self.perm), RANK_SEED)
        total = sum(ranks)
        self.q = [max(r / total, 1e-3) for r in ranks[:self.children]]  # a confidence per rank, like the pair's

    def expand(self, rows, s):
        super().expand(rows, s)
        return [synthetic_proposals(token, self.perm, self.rank, self.q, self.children) for token, *_ in rows]


def build(target: Path, draft: Path, device: str, dtype: str, synthetic=None, rows: int = 0,
          compile_draft: bool = False, modes=tuple(MODES), compile_frames: bool = False, fuse_draft: bool = True):
    """The head's models, one drafter and speculator per mode of ``modes`` (sharing the models), and the hello;
    ``rows``: every forward of the target at that row count (0: each at its own); ``compile_draft``:
    each mode's draft step compiled (``Drafter.capture(compile=)``; one program per mode and window);
    ``fuse_draft``: the draft's projections merged (``Drafter(fuse=)``, the product's default)."""
    dev, dt = torch.device(device), DTYPES[dtype]
    src, dsrc = ModelSource.open(str(target)), ModelSource.open(str(draft))
    L = n_layers(src.config)
    pools = {m: (f * (inflight + 1) + 1, min(((inflight + 1) * K + ahead) * w, 512) + 1)
             for m, (f, w, _, inflight, ahead, _) in MODES.items()}
    head_pool = max(p for p, _ in pools.values())  # one head graph per frame shape: every mode's pool the same
    kv_len = MAX_CONTEXT + max(max(p) for p in pools.values())
    head = ModelSlice.load(src, 0, L // 2, embed=True, head=False, dtype=dt, device=dev, max_len=kv_len,
                           rows=rows or None, compiled=compile_frames)
    dmodel = ModelSlice.load(dsrc, 0, n_layers(dsrc.config), embed=True, head=True, dtype=dt, device=dev,
                             max_len=draft_slots(kv_len))  # as the product sizes its draft's cache
    specs = {}
    attention.allow_recompiles(len(MODES) * len(dmodel.windows))  # a compiled draft: a program per mode and window
    for mode, (size, width, children, *_) in ((m, MODES[m]) for m in MODES if m in modes):
        kind = SyntheticDrafter if synthetic else Drafter
        extra = dict(perm=synthetic[0], ranks=synthetic[1]) if synthetic else {}
        drafter = (kind(dmodel, width=width, children=children, pool=pools[mode][1], fuse=fuse_draft, **extra)
                   if mode != "none" else None)
        if dev.type == "cuda":
            if drafter is not None:
                drafter.capture(compile=compile_draft)
            if not head.captured(rows or size, tree=True):  # one row count: every mode's frames one graph
                head.capture(rows or size, tree=True, span=head_pool)
        specs[mode] = Speculator(head, drafter, max_context=MAX_CONTEXT, frame_size=size, steps=K if drafter else 0,
                                 head_pool=head_pool)
    frames = (rows,) if rows else tuple(sorted({f for f, *_ in MODES.values()}))
    hello = Hello(model=str(target), revision=None, split=L // 2, dtype=DTYPE_NAMES[dt], max_len=kv_len, n_layers=L,
                  hidden_size=src.config.hidden_size, frames=frames, graphs=dev.type == "cuda", one_shape=bool(rows))
    return specs, hello


def timed_parts(targets, cuda: bool):
    """Each (object, method name) of ``targets`` wrapped so that its calls are timed, synchronized on
    a GPU before and after (so a part's time is its own, queued work included): the dict of name ->
    ms per call, and a function that puts the methods back."""
    parts: dict[str, list[float]] = {}
    undo = []
    for obj, name in targets:
        fn, own = getattr(obj, name), name in vars(obj)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = _fn(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
            parts.setdefault(_name, []).append((time.perf_counter() - t) * 1e3)
            return out
        setattr(obj, name, wrapped)
        undo.append((obj, name, own, fn))

    def restore() -> None:
        for obj, name, own, fn in undo:
            setattr(obj, name, fn) if own else delattr(obj, name)
    return parts, restore


def run_mode(spec, inflight: int, ahead: int, plan: str, link, hello, prompts, n_new: int,
             sampling: Sampling = GREEDY, parts: bool = False, verdicts: bool = False):
    """Every prompt's whole reply in one mode: tokens, wall time, per-verdict figures, token ids;
    with ``parts``, the median ms of each part of a frame's build (synchronized: slower frames);
    with ``verdicts``, every verdict's figures in order (``per_verdict``)."""
    driver = RoundDriver(spec, link, policy=PipelinePolicy(inflight, schedules(plan)), max_in_flight=inflight,
                         round_timeout=120, ahead_steps=ahead)
    driver.connect(hello)
    spec.head.reset()  # every mode computes the prompts' K/V itself
    built = []  # every steady frame's build: (draft ms, head ms, draft steps)
    frame = spec.frame

    def recorded(*args, **kw):
        f = frame(*args, **kw)
        if f is not None and f.steady:
            built.append((f.draft_ms, f.head_ms, f.steps))
        return f

    spec.frame = recorded
    timed, restore = timed_parts([(spec, "_grow"), (LiveTree, "choose"), (spec.scratch, "tree_inputs"),
                                  (spec.head, "run"), (spec, "_encode"), (spec, "take")], spec.device.type == "cuda") if parts \
        else ({}, lambda: None)
    stats, ids_out, wall = [], [], 0.0
    collections = heap.FullCollections()
    for ids in prompts:
        t0 = time.perf_counter()
        driver.begin(ids)
        got: list[int] = []
        while len(got) < n_new:
            out = driver.round(sampling, set(), n_new - len(got))
            got.extend(out.commit.tokens)
            stats.append(out.stats)
        wall += time.perf_counter() - t0
        ids_out.append(got)
    del spec.frame
    restore()
    full = collections.stop()
    counts = driver.policy.counts
    decisions = [dataclasses.asdict(d) for d in driver.policy.decisions]
    if len(counts) > 1:
        p = driver.policy
        print("measured tokens/ms: " + ", ".join(f"{k} {m.rate():.4f} ({m.counted})" for k, m in p.measured.items())
              + f"; the link fitted as {p.base_ms:.1f} ms + {p.ms_per_byte * 1e6:.1f} ms/MB; choices: "
              + "; ".join(f"after verdict {d['verdict']}: {d['chosen']}{' (trial)' if d['trial'] else ' (sure)' if d['sure'] else ''} on "
                          + ", ".join(f"{k} {r:.4f} +- {e:.4f} ({n})" for k, (r, n, e) in d["rates"].items())
                          + "".join(f", {k} forecast {r:.4f}" for k, r in d["forecasts"].items())
                          + (f", {d['skipped']}'s trial skipped" if d["skipped"] else "") for d in decisions)
              + ("none yet" if not decisions else ""), file=sys.stderr)
    return (summary(stats, sum(map(len, ids_out)), wall, driver.policy.max_in_flight)
            | {"ids": ids_out, "schedules": {k: v / max(1, sum(counts.values())) for k, v in counts.items()},
               "decisions": decisions,
               "frame_draft_ms": statistics.fmean(b[0] for b in built) if built else 0.0,
               "frame_head_ms": statistics.fmean(b[1] for b in built) if built else 0.0,
               "frame_head_ms_median": statistics.median(b[1] for b in built) if built else 0.0,
               "frame_head_ms_max": max((b[1] for b in built), default=0.0),
               "frame_parts_ms": {k: (statistics.median(v), len(v)) for k, v in timed.items()},
               "frame_steps": statistics.fmean(b[2] for b in built) if built else 0.0,
               "full_collections_ms": full}
            | ({"per_verdict": verdict_rows(stats)} if verdicts else {}))


def summary(stats, tokens: int, wall: float, inflight: int) -> dict:
    n = len(stats)
    out = {"tps": tokens / wall, "tokens": tokens, "verdicts": n, "tokens_per_verdict": tokens / n,
           "in_flight": sum(s.in_flight for s in stats) / n, "max_in_flight": inflight,
           "frame_nodes": sum(s.tree_nodes for s in stats) / n,
           "empty": sum(s.committed == 0 for s in stats) / n}  # verdicts that committed nothing (a voided frame)
    for f in FIELDS:
        out[f] = statistics.fmean(getattr(s, f) for s in stats)
    out["rest_ms"] = out["round_ms"] - out["draft_ms"] - out["head_ms"] - out["overlap_ms"] - out["wait_ms"]
    return out


def prompts_for(target: Path, synthetic: bool, count: int) -> list[list[int]]:
    if synthetic:
        return [list(range(200 + 37 * i, 328 + 37 * i)) for i in range(count)]
    from transformers import AutoTokenizer

    from tree_accept import PROMPTS

    tok = AutoTokenizer.from_pretrained(target)
    texts = [p for kind in PROMPTS.values() for p in kind[:count // len(PROMPTS)]]
    return [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for t in texts]


def scratch_dir() -> Path:
    """A temporary folder for the bench's checkpoints (a 7B pair is ~16 GB), removed when the
    process ends, by ``timeout``'s SIGTERM too: runs one after another on one disk must not fill it."""
    root = Path(tempfile.mkdtemp(prefix="sfchat-live-bench-"))

    def remove():  # a SIGTERM that comes while it removes must not leave half the folder
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutil.rmtree(root, ignore_errors=True)
    atexit.register(remove)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the tail stops, atexit runs
    return root


def main() -> None:
    global K
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=Path, help="a real target's model directory; its round4 copy drafts")
    ap.add_argument("--ranks", type=Path, help="synthetic: a real pair's rank histogram (JSON list)")
    ap.add_argument("--self", dest="self_shape", choices=sorted(SELF_SHAPES),
                    help="a random checkpoint of this shape drafting for itself")
    ap.add_argument("--k", type=int, default=K, help="draft steps per frame (a chain's nodes: K + 1)")
    ap.add_argument("--rtts", default="0,30,86,175")
    ap.add_argument("--mbps", type=float, default=0.0, help="the relay's emulated bandwidth each way (0: unlimited)")
    ap.add_argument("--new", type=int, default=128, help="tokens per reply")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--frame-rows", type=int, default=64, help="every forward of the target at N rows (0: off)")
    ap.add_argument("--compile-attention", action="store_true",
                    help="head and tail run canonical attention compiled (sfchat --compile-attention)")
    ap.add_argument("--compile-draft", action="store_true",
                    help="compile the draft's step for each window, as sfchat does by default (off: plain, graphed)")
    ap.add_argument("--unfused-draft", action="store_true",
                    help="the draft's q/k/v and gate/up projections as loaded (sfchat merges them)")
    ap.add_argument("--tail-logs", type=Path, help="write each RTT's tail output to DIR/tail-RTT.log")
    ap.add_argument("--frame-parts", action="store_true",
                    help="time a frame's parts (draft, choosing, tree inputs, head forward, encoding) and the "
                         "taking of a verdict, each synchronized: the median ms per call (slows every frame a little)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at T (0: greedy)")
    ap.add_argument("--seed", type=int, default=1, help="the sampled replies' seed")
    ap.add_argument("--reference-once", action="store_true",
                    help="run mode none at the first RTT only: the identity reference (a token a round trip "
                         "is slow at a long one)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--save", type=Path)
    ap.add_argument("--verdicts", action="store_true", help="--save every verdict's figures too (per_verdict)")
    ap.add_argument("--ranks-out", type=Path)
    ap.add_argument("--compile-frames", action="store_true",
                    help="head and tail compile the target's one-shape forwards whole (sfchat --compile-frames)")
    ap.add_argument("--no-settle", action="store_true",
                    help="leave the head's heap unfrozen after loading (the product freezes it: sfchat.node.heap)")
    args = ap.parse_args()
    if args.pair:
        from tree_accept import PROMPTS
        if args.prompts <= 0 or args.prompts % len(PROMPTS):  # prompts_for takes as many of each kind
            ap.error(f"--prompts with --pair: a multiple of {len(PROMPTS)} (as many of each kind: {', '.join(PROMPTS)})")
    harness.DEVICE = "cpu" if args.smoke else args.device
    K = args.k
    MODES["chain"] = (K + 1, *MODES["chain"][1:])
    rtts = [int(x) for x in args.rtts.split(",")]
    synthetic = None
    if args.pair:
        from tree_accept import quantised_copy

        target = args.pair.resolve()
        draft = quantised_copy(target, target.parent / f"{target.name}-round4", "round4")
    elif args.self_shape:
        target = scratch_dir() / "target"
        harness.write_checkpoint(target, SELF_SHAPES[args.self_shape], seed=0)
        draft = target
    else:
        root = scratch_dir()
        shapes = (TINY_TARGET, TINY_DRAFT) if args.smoke else (QWEN25_7B, QWEN25_05B)
        vocab = shapes[1]["vocab_size"]
        harness.write_checkpoint(root / "target", shapes[0], seed=0, follows=vocab)
        harness.write_checkpoint(root / "draft", shapes[1], seed=1)
        target, draft = root / "target", root / "draft"
        ranks = json.loads(args.ranks.read_text()) if args.ranks else [78, 9, 4, 2, 1, 1, 1, 0, 4]
        synthetic = (torch.randperm(vocab, generator=torch.Generator().manual_seed(1234)), ranks)
    dtype = "float32" if args.smoke or args.device == "cpu" else args.dtype
    attention.compile_on_gpu(args.compile_attention)
    if args.tail_logs:
        args.tail_logs.mkdir(parents=True, exist_ok=True)
    t_build = time.perf_counter()
    specs, hello = build(target, draft, harness.DEVICE, dtype, synthetic, args.frame_rows, args.compile_draft,
                         modes=args.modes.split(","), compile_frames=args.compile_frames,
                         fuse_draft=not args.unfused_draft)
    print(f"the head loaded and captured in {time.perf_counter() - t_build:.1f} s", file=sys.stderr, flush=True)
    if not args.no_settle:
        heap.settle()  # as the product's head does once it is loaded
    hello = dataclasses.replace(hello, compiled_attention=args.compile_attention,
                                compiled_frames=args.compile_frames)  # the tail follows them
    prompts = prompts_for(target, synthetic is not None or bool(args.self_shape), args.prompts)
    res = {}
    for rtt in rtts:
        log = args.tail_logs / f"tail-{rtt}.log" if args.tail_logs else None
        with relay_and_tail(rtt, target.parent, session=f"live-{rtt}", mbps=args.mbps,
                            tail_log=log) as url:
            link = head_link(url, f"live-{rtt}")
            for mode in modes_at(args.modes.split(","), rtt, rtts, args.reference_once):
                res[(mode, rtt)] = r = run_mode(specs[mode], *MODES[mode][3:], link, hello, prompts, args.new,
                                                Sampling(temperature=args.temperature, seed=args.seed),
                                                parts=args.frame_parts, verdicts=args.verdicts)
                print(f"rtt {rtt} {mode}: " + row(r, None, rtt), file=sys.stderr, flush=True)  # a run cut short keeps it
                print(f"rtt {rtt} {mode}: verdicts that committed nothing {r['empty']:.1%}; "
                      f"a frame's head ms: mean {r['frame_head_ms']:.2f}, median "
                      f"{r['frame_head_ms_median']:.2f}, max {r['frame_head_ms_max']:.1f}"
                      + "".join(f"; {k} {ms:.2f} ({n} calls)" for k, (ms, n) in r["frame_parts_ms"].items())
                      + f"; the head's full collections: {len(r['full_collections_ms'])}, "
                        f"{sum(r['full_collections_ms']):.0f} ms in all, the longest {max(r['full_collections_ms'], default=0):.0f}",
                      file=sys.stderr, flush=True)
                if args.save:  # each mode as it ends: a run cut short by a timeout keeps its token ids
                    save(args.save, res)
            link.close()
    modes = args.modes.split(",")
    trees = [m for m in ("auto", "stream", "tree", "tree-ahead") if m in modes]
    ranks = specs[(trees or modes)[0]].calibration.ranks  # a tree's: the draft's proposals ranked
    print_table(res, rtts, modes, ranks, args.reference_once)
    if args.ranks_out:
        args.ranks_out.write_text(json.dumps(ranks))


if __name__ == "__main__":
    main()
