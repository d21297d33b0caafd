"""Qwen2.5-7B (dense), -32B and -72B (NF4) halves on one GPU: what each node really holds, phase by
phase, against the memory estimate; and what a frame costs.

Random weights in the public shapes of the models (configs written here by hand, no checkpoint on
disk: ``RandomSource`` hands ``ModelSlice.load`` tensors drawn on the device, so loading, NF4
quantisation one layer at a time, capture and replay are sfchat's own code). For each model,
dtype and segment count (1, and 2: each half cut into two segments on the one GPU, the code that
runs a half over two T4s), one node at a time, each in a process of its own (what CUDA loads on
first use, kernels of torch, cuBLAS and bitsandbytes, then counts for every node as it does for a
fresh sfchat):

* head node: the draft (0.5B shapes, dense, graphed as ``Drafter.capture`` does, not compiled) and
  layers [0, L/2) with the embedding; the graphs ``loading.capture_graphs`` takes (the draft's
  expansion step, the head over a frame (``--tree-budget`` drafts and the root) seeing its scratch pool of ``--max-in-flight`` 8
  frames); the context fed in 512-token chunks as the head does (``--context``, default: all of
  ``--max-context``, so that the widest attention windows run); timed: one expansion step of the
  draft (a frame takes K=8 of them), the head over a frame;
* tail node: layers [L/2, L) with norm and lm_head, the graph of the HELLO's frame shape, the
  context's hidden states fed in 512-row chunks; timed: the tail forward over a frame plus
  ``sampling.picks`` (what a verdict costs the tail);
* memory, per phase (load, capture, prefill, frames): torch's peak allocated and reserved bytes
  and what is held at the phase's end, and the device memory in use beyond torch's reservations
  (growth of the CUDA context: modules loaded on first use, graph executables) from
  ``mem_get_info``; *device peak* = peak reserved + that; beside them the estimate of
  ``memory.head_plan`` / ``memory.tail_plan`` for the same layout (which must not be below the
  device peak);
* derived (not measured end to end): a verdict = K draft steps + head + tail + RTT, tok/s =
  tokens per verdict / that at 86 and 175 ms, with the tokens per verdict assumed (``--tokens``:
  random weights accept nothing meaningful).

The halves are measured as they ran before ``--frame-rows`` (each forward at its own size over the
smallest window, masked attention, 512-row prefill chunks): ``--frame-rows 0``. The one-shape path
a GPU runs by default now (64 rows, canonical attention) is not measured by this script yet.

Run from the repository root:  python3 bench/bigmodel_bench.py [--models 7B 32B 72B] [--dtypes float16]
[--out r.json]. A CPU check of the script: python3 bench/bigmodel_bench.py --tiny (tiny shapes,
fp32, NF4 through bitsandbytes' CPU backend, nothing graphed, no memory figures). Needs torch,
transformers, bitsandbytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from sfchat.config import AUTO_TREE_BUDGET, Settings  # noqa: E402
from sfchat.engine import sampling  # noqa: E402
from sfchat.engine.draft import CHILDREN, Drafter  # noqa: E402
from sfchat.model import memory  # noqa: E402
from sfchat.model.footprint import GIB, device_bytes  # noqa: E402
from sfchat.model.kv import PREFILL_CHUNK, TreeMask  # noqa: E402
from sfchat.model.memory import DraftPlan, head_plan, tail_plan  # noqa: E402
from sfchat.model.slices import ModelSlice  # noqa: E402
from sfchat.node.loading import capture_graphs, frame_layout  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab): the public Qwen2.5 configs
    "7B": (3584, 18944, 28, 28, 4, 152064),
    "32B": (5120, 27648, 64, 40, 8, 152064),
    "72B": (8192, 29568, 80, 64, 8, 152064),
    "tiny": (128, 256, 8, 4, 2, 512),
}
QUANT = {"7B": "none", "32B": "nf4", "72B": "nf4", "tiny": "nf4"}
# README's layout table: the longest --max-context of two notebooks (72B fits none: the default)
PROMISED = {"7B": 32768, "32B": 19456, "72B": 4096, "tiny": 1024}
DRAFT = {"0.5B": (896, 4864, 24, 14, 2, 151936), "tiny": (128, 256, 2, 4, 2, 512)}
K = 8
TREE = int(os.environ.get("SFCHAT_BENCH_TREE", AUTO_TREE_BUDGET))  # --tree-budget, handed to the children so
LAYOUT = frame_layout(Settings(k=K, tree_budget=TREE, frame_rows=0), K, cuda=True)  # the frame and pools, --frame-rows 0
VERIFIES = [(LAYOUT.size, True)]  # the HELLO's frame shapes
GREEDY = Sampling()


def qwen2(shape, tied: bool) -> Qwen2Config:
    hidden, inter, layers, heads, kv_heads, vocab = shape
    return Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       tie_word_embeddings=tied, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)


class RandomSource:
    """A ``ModelSource`` stand-in whose tensors are drawn on demand (norms 1, the rest N(0, 0.02)),
    in bf16 as the checkpoints are stored."""

    def __init__(self, config, seed: int):
        self.config, self.name, self.seed = config, "random", seed
        with torch.device("meta"):
            self.shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
        if config.tie_word_embeddings:
            self.shapes.pop("lm_head.weight", None)
        self.weight_map = {n: "random" for n in self.shapes}
        self.gap = 0  # on a GPU: the most torch held reserved but unallocated while loading

    def read(self, names, device: str, progress=None):
        gen = torch.Generator(device=device).manual_seed(self.seed)
        for name in names:
            if device.startswith("cuda"):
                self.gap = max(self.gap, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
            t = torch.empty(self.shapes[name], dtype=torch.bfloat16, device=device)
            yield name, (t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, 0.02, generator=gen))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, n: int) -> float:
    """Mean ms of ``fn`` over ``n`` calls after three warm-ups."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / n


class Memory:
    """What one node holds on its GPU, phase by phase, from the moment before it loads anything."""

    def __init__(self, device):
        self.device, self.phases = device, {}
        if device.type == "cuda":
            torch.cuda.init()
            torch.cuda.synchronize(device)
            self.used0, self.reserved0 = self.used(), torch.cuda.memory_reserved(device)
            torch.cuda.reset_peak_memory_stats(device)

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def phase(self, name: str) -> None:
        """Close a phase: its peaks, and what is held at its end (GiB since the start)."""
        if self.device.type != "cuda":
            return
        gc.collect()
        d = self.device
        torch.cuda.synchronize(d)
        reserved = torch.cuda.memory_reserved(d) - self.reserved0
        self.phases[name] = {"peak_allocated": torch.cuda.max_memory_allocated(d) / GIB,
                             "peak_reserved": (torch.cuda.max_memory_reserved(d) - self.reserved0) / GIB,
                             "allocated": torch.cuda.memory_allocated(d) / GIB, "reserved": reserved / GIB,
                             "outside_torch": (self.used() - self.used0 - reserved) / GIB}
        torch.cuda.reset_peak_memory_stats(d)

    def figures(self) -> dict:
        if self.device.type != "cuda":
            return {}
        peak = max(p["peak_reserved"] for p in self.phases.values())
        outside = max(p["outside_torch"] for p in self.phases.values())
        return {"context_gib": self.used0 / GIB, "peak_reserved_gib": peak, "outside_torch_gib": outside,
                "peak_device_gib": peak + outside, "phases": self.phases}


def estimate(plan) -> dict:
    """The estimate of ``plan`` on its one GPU, and its parts (GiB)."""
    needs = [need for _, _, need in plan]
    return {"estimate_gib": device_bytes(needs) / GIB,
            "parts": {what: {"weights": n.weights / GIB, "kv": n.kv / GIB, "work": n.work / GIB,
                             "graphs": len(n.graphs)} for what, _, n in plan}}


def kv_bytes(*models) -> int:
    return sum(t.numel() * t.element_size() for m in models for t in m.kv_tensors())


def frame_tree(size: int, fanout: int = CHILDREN) -> list[int]:
    """Parents (frame indices, -1: the root) of a ``size``-node frame: a ``fanout``-ary tree, as wide
    as the frames best-first growth builds when the draft is unsure."""
    return [-1] + [(i - 1) // fanout for i in range(1, size)]


def frame_mask(parents: list[int], base: int, span: int, device) -> tuple[torch.Tensor, TreeMask]:
    """Slots (base ..) and the tree mask of a frame whose nodes see their ancestors and themselves."""
    depth = [0] * len(parents)
    visible = torch.zeros(len(parents), span, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            visible[i] = visible[p]
        visible[i, i] = True
    rope = torch.tensor([base + d for d in depth], device=device)
    return torch.arange(base, base + len(parents), device=device), TreeMask(rope, torch.tensor([base], device=device),
                                                                             visible.to(device))


def head_node(cfg, dcfg, quant: str, segments: int, device, dtype, context: int, max_context: int, n: int) -> dict:
    """Draft and head half on ``device``: one expansion step of the draft, the head over a frame."""
    L = cfg.num_hidden_layers
    max_len = max_context + LAYOUT.scratch
    devices = [device] * segments
    mem = Memory(device)
    draft_plan = DraftPlan(dcfg, device, dtype, "none", rows=LAYOUT.width + 1, children=LAYOUT.children,
                           pool=LAYOUT.draft_pool)
    fig = estimate(head_plan(cfg, L // 2, devices=devices, dtype=dtype, quant=quant, max_len=max_len,
                             verifies=VERIFIES, draft=draft_plan, head_span=LAYOUT.head_pool))
    t0 = time.perf_counter()
    dmodel = ModelSlice.load(RandomSource(dcfg, 2), 0, dcfg.num_hidden_layers, embed=True, head=True, dtype=dtype,
                             device=device, max_len=max_len)
    drafter = Drafter(dmodel, width=LAYOUT.width, children=LAYOUT.children, pool=LAYOUT.draft_pool)
    src = RandomSource(cfg, 1)
    head = ModelSlice.load(src, 0, L // 2, embed=True, head=False, dtype=dtype, device=device, max_len=max_len,
                           quant=quant, devices=devices)
    fig["load_s"] = time.perf_counter() - t0
    fig["load_gap_gib"], fig["kv_gib"] = src.gap / GIB, kv_bytes(head, dmodel) / GIB
    mem.phase("load")
    if device.type == "cuda":  # what the head captures before any conversation
        capture_graphs(head, drafter, LAYOUT, False, lambda *a: None)
        assert head.captured(LAYOUT.size, tree=True) and drafter.graphs, "a head graph could not be captured"
    mem.phase("capture")
    tokens = [int(t) for t in torch.randint(0, dcfg.vocab_size, (context,))]
    for start in range(0, context, PREFILL_CHUNK):  # the context, as the head's prefill chunks
        piece = torch.tensor(tokens[start:min(start + PREFILL_CHUNK, context)], device=device)
        head.run(piece, torch.arange(start, start + len(piece), device=device), end=start + len(piece))
    drafter.sync(tokens)
    mem.phase("prefill")
    # one expansion step: ``width`` nodes of a tree below the context and one committed node to catch up
    base = drafter.scratch.n
    rows = [(tokens[-1], context, base, [])] + [(7 + i, context + 1, base + 1 + i, [base]) for i in range(LAYOUT.width)]
    fig["draft_step_ms"] = timed(lambda: drafter.expand(rows, GREEDY), device, n)
    ids = torch.tensor([tokens[-1]] + [7 + i for i in range(LAYOUT.size - 1)], device=device)
    slots, mask = frame_mask(frame_tree(LAYOUT.size), context, LAYOUT.head_pool, device)
    fig["head_frame_ms"] = timed(lambda: head.run(ids, slots, end=context + LAYOUT.head_pool, tree=mask), device, n)
    mem.phase("frames")
    fig.update(mem.figures())
    fig["segments_placed"] = [list(r) for r in head.ranges]
    return fig


def tail_node(cfg, quant: str, segments: int, device, dtype, context: int, max_context: int, n: int) -> dict:
    """The tail half on ``device``: its forward over a frame and the picks, as a verdict costs."""
    L = cfg.num_hidden_layers
    max_len = max_context + LAYOUT.scratch
    m = LAYOUT.size
    mem = Memory(device)
    fig = estimate(tail_plan(cfg, L // 2, devices=[device] * segments, dtype=dtype, quant=quant, max_len=max_len,
                             verifies=VERIFIES))
    t0 = time.perf_counter()
    src = RandomSource(cfg, 1)
    tail = ModelSlice.load(src, L // 2, L, embed=False, head=True, dtype=dtype, device=device, max_len=max_len,
                           quant=quant, devices=[device] * segments)
    fig["load_s"] = time.perf_counter() - t0
    fig["load_gap_gib"], fig["kv_gib"] = src.gap / GIB, kv_bytes(tail) / GIB
    mem.phase("load")
    if device.type == "cuda":
        for positions, is_tree in VERIFIES:  # as the verifier captures a HELLO's shapes
            assert tail.capture(positions, positions, tree=is_tree), "a tail graph could not be captured"
    mem.phase("capture")
    gen = torch.Generator(device=device).manual_seed(3)

    def hidden(rows: int) -> torch.Tensor:  # as a FORWARD's rows arrive: one chunk at a time
        return torch.randn(rows, cfg.hidden_size, device=device, generator=gen).mul_(0.1).to(dtype)

    for start in range(0, context, PREFILL_CHUNK):
        stop = min(start + PREFILL_CHUNK, context)
        tail.run(hidden(stop - start), torch.arange(start, stop, device=device), 1, end=stop)
    mem.phase("prefill")
    slots, mask = frame_mask(frame_tree(m), context, m, device)
    positions = mask.rope.tolist()
    rows = hidden(m)

    def verify():
        return sampling.picks(tail.run(rows, slots, m, end=context + m, tree=mask), positions, GREEDY).tolist()

    fig["tail_frame_ms"] = timed(verify, device, n)
    mem.phase("frames")
    fig.update(mem.figures())
    fig["segments_placed"] = [list(r) for r in tail.ranges]
    return fig


def run_node(spec: dict) -> dict:
    """One node as ``spec`` says (in this process)."""
    tiny = spec["model"] == "tiny"
    device = torch.device("cpu" if tiny else "cuda")
    dtype = getattr(torch, spec["dtype"])
    cfg = qwen2(SHAPES[spec["model"]], tied=False)
    common = dict(quant=spec["quant"], segments=spec["segments"], device=device, dtype=dtype,
                  context=spec["context"], max_context=spec["max_context"], n=spec["n"])
    if spec["node"] == "head":
        return head_node(cfg, qwen2(DRAFT["tiny" if tiny else "0.5B"], tied=True), **common)
    return tail_node(cfg, **common)


def in_child(spec: dict, alloc_conf: str | None) -> dict:
    """``run_node(spec)`` in a fresh process (its figures on its last line of output)."""
    env = dict(os.environ) | ({"PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf else {})
    done = subprocess.run([sys.executable, __file__, "--node", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def derive(head: dict, tail: dict, rtts, tokens: float) -> dict:
    """tok/s of one frame per round trip from the measured compute (K expansion steps, the head's
    frame, the tail's) and an assumed RTT and tokens per verdict (derived figures)."""
    compute = K * head["draft_step_ms"] + head["head_frame_ms"] + tail["tail_frame_ms"]
    return {"compute_ms": compute, **{f"tok_s_{rtt}": tokens / (compute + rtt) * 1e3 for rtt in rtts}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["7B", "32B", "72B"], choices=["7B", "32B", "72B"])
    ap.add_argument("--quant", choices=["none", "nf4", "int8"], default=None, help="default: 7B dense, 32B and 72B NF4")
    ap.add_argument("--segments", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--dtypes", nargs="*", default=["float16"], choices=["float16", "bfloat16"],
                    help="float16 as on a T4 (default), and/or bfloat16")
    ap.add_argument("--max-context", type=int, default=None,
                    help="KV slots besides a round's scratch (default: what README's layout table promises)")
    ap.add_argument("--context", type=int, default=None, help="tokens fed before the timed frames (default: all)")
    ap.add_argument("--nodes", nargs="*", default=["head", "tail"], choices=["head", "tail"])
    ap.add_argument("--n", type=int, default=10, help="timed calls per figure")
    ap.add_argument("--rtt", type=int, nargs="*", default=[86, 175])
    ap.add_argument("--tokens", type=float, default=5.42,
                    help="assumed tokens per verdict of a 64-draft frame (5.42: the SmolLM2 pair, bench/RESULTS.md)")
    ap.add_argument("--tree-budget", type=int, default=None,
                    help=f"drafts per frame (default: --tree-budget auto on a GPU, {AUTO_TREE_BUDGET})")
    ap.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF of the nodes' processes")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a check of the script")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--node", default=None, help=argparse.SUPPRESS)  # a child: one node's spec, as JSON
    args = ap.parse_args()
    if args.tree_budget is not None and args.tree_budget != TREE:  # the frame is decided at import: run again
        os.environ["SFCHAT_BENCH_TREE"] = str(args.tree_budget)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.node:
        print(json.dumps(run_node(json.loads(args.node))))
        return
    models = ["tiny"] if args.tiny else args.models
    dtypes = ["float32"] if args.tiny else args.dtypes
    where = "cpu (tiny shapes)" if args.tiny else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, K={K}, tree {TREE}, --max-in-flight 8 "
          f"(head pool {LAYOUT.head_pool} slots){', ' + args.alloc_conf if args.alloc_conf else ''}", flush=True)
    results = []
    for name in models:
        max_context = args.max_context or PROMISED[name]
        for dtype in dtypes:
            for segments in args.segments:
                spec = dict(model=name, quant=args.quant or QUANT[name], dtype=dtype, segments=segments,
                            max_context=max_context, context=min(args.context or max_context, max_context), n=args.n)
                r = dict(spec)
                for node in args.nodes:
                    r[node] = in_child(dict(spec, node=node), args.alloc_conf)
                    print(f"{name} {dtype} x{segments} {node} node: {json.dumps(r[node])}", flush=True)
                if "draft_step_ms" in r.get("head", {}) and "tail_frame_ms" in r.get("tail", {}):
                    r["derived"] = derive(r["head"], r["tail"], args.rtt, args.tokens)
                results.append(r)
                if args.out:
                    args.out.write_text(json.dumps({"device": where, "results": results}, indent=1))
    print_tables(results, args.rtt)


def print_tables(results: list[dict], rtts) -> None:
    def memory(node):
        if "error" in node:
            return "failed, -, -"
        if "peak_reserved_gib" not in node:
            return f"-, -, {node['estimate_gib']:.2f}"
        over = node["estimate_gib"] / node["peak_device_gib"] - 1
        return (f"{node['peak_reserved_gib']:.2f}, {node['peak_device_gib']:.2f}, {node['estimate_gib']:.2f} "
                f"({over:+.1%})")

    nodes = [n for n in ("head", "tail") if any(n in r for r in results)]
    print("\n| model | weights | dtype | segments per half | --max-context (fed) | "
          + " | ".join(f"{n} node GiB: peak reserved, device peak, estimate (over)" for n in nodes) + " |")
    print("| --- " * (5 + len(nodes)) + "|")
    for r in results:
        print(f"| {r['model']} | {dict(nf4='NF4', int8='int8').get(r['quant'], 'dense')} | {r['dtype']} | {r['segments']} | "
              f"{r['max_context']} ({r['context']}) | " + " | ".join(memory(r[n]) for n in nodes if n in r) + " |")
    timed_rows = [r for r in results if "derived" in r]
    if not timed_rows:
        return
    print(f"\n| model | dtype | segments per half | draft ms per step (x{K} per frame) | head ms per frame | "
          "tail ms per frame | " + " | ".join(f"tok/s at {r} ms (derived)" for r in rtts) + " |")
    print("| --- " * (6 + len(rtts)) + "|")
    for r in timed_rows:
        h, t, d = r["head"], r["tail"], r["derived"]
        print(f"| {r['model']} | {r['dtype']} | {r['segments']} | {h['draft_step_ms']:.2f} | {h['head_frame_ms']:.1f} | "
              f"{t['tail_frame_ms']:.1f} | " + " | ".join(f"{d[f'tok_s_{x}']:.1f}" for x in rtts) + " |")


if __name__ == "__main__":
    main()
