"""Qwen2.5-32B and -72B in NF4, split in two halves on one GPU, with the 0.5B draft, graphed.

Random weights in the public shapes of the models (configs written here by hand, no checkpoint on
disk: ``RandomSource`` hands ``ModelSlice.load`` tensors drawn on the device, so loading, NF4
quantisation one layer at a time, capture and replay are sfchat's own code). For each model and
each segment count (1, and 2: each half cut into two segments on the one GPU, the code that runs a
half over two T4s), one node at a time:

* head node: the draft (0.5B shapes, dense, graphed as ``Drafter.capture`` does) and layers
  [0, L/2) with the embedding; the graphs ``loading.capture_graphs`` takes (the draft's expansion
  step, the head over a 65-node frame seeing its scratch pool); a context of ``--context`` tokens
  fed; timed: one expansion step of the draft (a frame takes K=8 of them), the head over a frame;
* tail node: layers [L/2, L) with norm and lm_head, the graph of the HELLO's frame shape; timed:
  the tail forward over a frame plus ``sampling.picks`` (what a verdict costs the tail);
* memory: what each node really peaks at (torch's peak reserved since it started loading, and
  the device's own used memory from ``mem_get_info``, which also sees graph executables) against
  the estimate of ``memory.head_plan`` / ``memory.tail_plan`` for the same layout;
* derived (not measured end to end): a verdict = K draft steps + head + tail + RTT, tok/s =
  tokens per verdict / that at 86 and 175 ms, with the tokens per verdict assumed (``--tokens``:
  random weights accept nothing meaningful).

Run from the repository root:  python3 bench/bigmodel_bench.py [--models 32B 72B] [--out r.json]
A CPU check of the script: python3 bench/bigmodel_bench.py --tiny (tiny shapes, fp32, NF4 through
bitsandbytes' CPU backend, nothing graphed). Needs torch, transformers, bitsandbytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from sfchat.config import Settings  # noqa: E402
from sfchat.engine import sampling  # noqa: E402
from sfchat.engine.draft import CHILDREN, Drafter  # noqa: E402
from sfchat.model.kv import TreeMask  # noqa: E402
from sfchat.model.footprint import GIB, device_bytes  # noqa: E402
from sfchat.model.memory import DraftPlan, head_plan, tail_plan  # noqa: E402
from sfchat.model.slices import ModelSlice  # noqa: E402
from sfchat.node.loading import capture_graphs, frame_layout  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab): the public Qwen2.5 configs
    "32B": (5120, 27648, 64, 40, 8, 152064),
    "72B": (8192, 29568, 80, 64, 8, 152064),
    "tiny": (128, 256, 8, 4, 2, 512),
}
DRAFT = {"0.5B": (896, 4864, 24, 14, 2, 151936), "tiny": (128, 256, 2, 4, 2, 512)}
K, TREE = 8, 64
LAYOUT = frame_layout(Settings(k=K, tree_budget=TREE), K, cuda=True)  # the GPU default's frame and pools
VERIFIES = [(LAYOUT.size, True)]  # the HELLO's frame shapes
GREEDY = Sampling()


def qwen2(shape, tied: bool) -> Qwen2Config:
    hidden, inter, layers, heads, kv_heads, vocab = shape
    return Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       tie_word_embeddings=tied, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)


class RandomSource:
    """A ``ModelSource`` stand-in whose tensors are drawn on demand (norms 1, the rest N(0, 0.02))."""

    def __init__(self, config, seed: int):
        self.config, self.name, self.seed = config, "random", seed
        with torch.device("meta"):
            self.shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
        if config.tie_word_embeddings:
            self.shapes.pop("lm_head.weight", None)
        self.weight_map = {n: "random" for n in self.shapes}

    def read(self, names, device: str, progress=None):
        gen = torch.Generator(device=device).manual_seed(self.seed)
        for name in names:
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
    """Peak memory of one node since ``start``: torch's reserved bytes, and the device's used ones."""

    def __init__(self, device):
        self.device = device
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            self.reserved0 = torch.cuda.memory_reserved(device)
            self.used0 = self.used()
        self.peak_used = 0

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def sample(self) -> None:
        if self.device.type == "cuda":
            self.peak_used = max(self.peak_used, self.used() - self.used0)

    def figures(self) -> dict:
        if self.device.type != "cuda":
            return {}
        self.sample()
        return {"peak_reserved_gib": (torch.cuda.max_memory_reserved(self.device) - self.reserved0) / GIB,
                "peak_device_gib": self.peak_used / GIB}


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


def head_node(cfg, dcfg, segments: int, device, dtype, context: int, n: int) -> dict:
    """Draft and head half on ``device``: one expansion step of the draft, the head over a frame."""
    L = cfg.num_hidden_layers
    max_len = context + LAYOUT.scratch
    devices = [device] * segments
    draft_plan = DraftPlan(dcfg, device, dtype, "none", rows=LAYOUT.width + 1, children=LAYOUT.children,
                           pool=LAYOUT.draft_pool, compiled=False)
    plan = head_plan(cfg, L // 2, devices=devices, dtype=dtype, quant="nf4", max_len=max_len, verifies=VERIFIES,
                     draft=draft_plan, head_span=LAYOUT.head_pool)
    mem = Memory(device)
    t0 = time.perf_counter()
    dmodel = ModelSlice.load(RandomSource(dcfg, 2), 0, dcfg.num_hidden_layers, embed=True, head=True, dtype=dtype,
                             device=device, max_len=max_len)
    drafter = Drafter(dmodel, width=LAYOUT.width, children=LAYOUT.children, pool=LAYOUT.draft_pool)
    head = ModelSlice.load(RandomSource(cfg, 1), 0, L // 2, embed=True, head=False, dtype=dtype, device=device,
                           max_len=max_len, quant="nf4", devices=devices)
    load_s = time.perf_counter() - t0
    mem.sample()
    if device.type == "cuda":  # what the head captures before any conversation
        capture_graphs(head, drafter, LAYOUT, False, lambda *a: None)
        assert head.captured(LAYOUT.size, tree=True) and drafter.graphs, "a head graph could not be captured"
    tokens = [int(t) for t in torch.randint(0, dcfg.vocab_size, (context,))]
    for start in range(0, context, 512):  # the context, as the head's prefill chunks
        piece = torch.tensor(tokens[start:min(start + 512, context)], device=device)
        head.run(piece, torch.arange(start, start + len(piece), device=device), end=start + len(piece))
    drafter.sync(tokens)
    mem.sample()
    # one expansion step: ``width`` nodes of a tree below the context and one committed node to catch up
    base = drafter.scratch.n
    rows = [(tokens[-1], context, base, [])] + [(7 + i, context + 1, base + 1 + i, [base]) for i in range(LAYOUT.width)]
    fig = {"load_s": load_s, "draft_step_ms": timed(lambda: drafter.expand(rows, GREEDY), device, n)}
    ids = torch.tensor([tokens[-1]] + [7 + i for i in range(LAYOUT.size - 1)], device=device)
    slots, mask = frame_mask(frame_tree(LAYOUT.size), context, LAYOUT.head_pool, device)
    fig["head_frame_ms"] = timed(lambda: head.run(ids, slots, end=context + LAYOUT.head_pool, tree=mask), device, n)
    fig.update(mem.figures())
    fig["estimate_gib"] = device_bytes(need for _, _, need in plan) / GIB
    fig["segments_placed"] = [list(r) for r in head.ranges]
    return fig


def tail_node(cfg, segments: int, device, dtype, context: int, n: int) -> dict:
    """The tail half on ``device``: its forward over a frame and the picks, as a verdict costs."""
    L = cfg.num_hidden_layers
    max_len = context + LAYOUT.scratch
    m = LAYOUT.size
    plan = tail_plan(cfg, L // 2, devices=[device] * segments, dtype=dtype, quant="nf4", max_len=max_len,
                     verifies=VERIFIES)
    mem = Memory(device)
    t0 = time.perf_counter()
    tail = ModelSlice.load(RandomSource(cfg, 1), L // 2, L, embed=False, head=True, dtype=dtype, device=device,
                           max_len=max_len, quant="nf4", devices=[device] * segments)
    load_s = time.perf_counter() - t0
    mem.sample()
    if device.type == "cuda":
        for positions, is_tree in VERIFIES:  # as the verifier captures a HELLO's shapes
            assert tail.capture(positions, positions, tree=is_tree), "a tail graph could not be captured"
    gen = torch.Generator(device=device).manual_seed(3)
    hidden = torch.randn(context + m, cfg.hidden_size, device=device, generator=gen).mul_(0.1).to(dtype)
    for start in range(0, context, 512):
        stop = min(start + 512, context)
        tail.run(hidden[start:stop], torch.arange(start, stop, device=device), 1, end=stop)
    mem.sample()
    slots, mask = frame_mask(frame_tree(m), context, m, device)
    positions = mask.rope.tolist()

    def verify():
        return sampling.picks(tail.run(hidden[context:context + m], slots, m, end=context + m, tree=mask),
                              positions, GREEDY).tolist()

    fig = {"load_s": load_s, "tail_frame_ms": timed(verify, device, n)}
    fig.update(mem.figures())
    fig["estimate_gib"] = device_bytes(need for _, _, need in plan) / GIB
    fig["segments_placed"] = [list(r) for r in tail.ranges]
    return fig


def derive(head: dict, tail: dict, rtts, tokens: float) -> dict:
    """tok/s of one frame per round trip from the measured compute (K expansion steps, the head's
    frame, the tail's) and an assumed RTT and tokens per verdict (derived figures)."""
    compute = K * head["draft_step_ms"] + head["head_frame_ms"] + tail["tail_frame_ms"]
    return {"compute_ms": compute, **{f"tok_s_{rtt}": tokens / (compute + rtt) * 1e3 for rtt in rtts}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["32B", "72B"], choices=["32B", "72B"])
    ap.add_argument("--segments", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--context", type=int, default=500, help="tokens of context before the timed rounds")
    ap.add_argument("--max-context", type=int, default=4096, help="KV slots besides a round's scratch")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                    help="float16 as on a T4 (default), or bfloat16")
    ap.add_argument("--n", type=int, default=20, help="timed calls per figure")
    ap.add_argument("--rtt", type=int, nargs="*", default=[86, 175])
    ap.add_argument("--tokens", type=float, default=5.42,
                    help="assumed tokens per verdict of a 64-draft frame (5.42: the SmolLM2 pair, bench/RESULTS.md)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a check of the script")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else getattr(torch, args.dtype)
    models = ["tiny"] if args.tiny else args.models
    dcfg = qwen2(DRAFT["tiny" if args.tiny else "0.5B"], tied=True)
    where = "cpu (tiny shapes)" if args.tiny else torch.cuda.get_device_name(device)
    print(f"{where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, K={K}, tree {TREE}, "
          f"context {args.context} of {args.max_context}", flush=True)
    results = []
    for name in models:
        cfg = qwen2(SHAPES[name], tied=False)
        for segments in args.segments:
            head = head_node(cfg, dcfg, segments, device, dtype, args.context, args.n)
            print(f"{name} x{segments} head node: {head}", flush=True)
            tail = tail_node(cfg, segments, device, dtype, args.context, args.n)
            print(f"{name} x{segments} tail node: {tail}", flush=True)
            results.append({"model": name, "segments": segments, "head": head, "tail": tail,
                            "derived": derive(head, tail, args.rtt, args.tokens)})
            if args.out:
                args.out.write_text(json.dumps({"device": where, "dtype": str(dtype), "results": results},
                                               indent=1))
    print_table(results, args.rtt)


def print_table(results: list[dict], rtts) -> None:
    print(f"\n| model | segments per half | draft ms per step (x{K} per frame) | head ms per frame | "
          "tail ms per frame | head node GiB: reserved, device, estimate | tail node GiB: reserved, device, estimate | "
          + " | ".join(f"tok/s at {r} ms (derived)" for r in rtts) + " |")
    print("| --- " * (7 + len(rtts)) + "|")
    for r in results:
        h, t, d = r["head"], r["tail"], r["derived"]

        def mem(node):
            if "peak_reserved_gib" not in node:
                return f"-, -, {node['estimate_gib']:.2f}"
            return f"{node['peak_reserved_gib']:.2f}, {node['peak_device_gib']:.2f}, {node['estimate_gib']:.2f}"

        print(f"| {r['model']} | {r['segments']} | {h['draft_step_ms']:.2f} | {h['head_frame_ms']:.1f} | "
              f"{t['tail_frame_ms']:.1f} | {mem(h)} | {mem(t)} | "
              + " | ".join(f"{d[f'tok_s_{x}']:.1f}" for x in rtts) + " |")


if __name__ == "__main__":
    main()
