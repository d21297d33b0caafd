"""Qwen2.5-32B and -72B in NF4, split in two halves on one GPU, with the 0.5B draft, graphed.

Random weights in the public shapes of the models (configs written here by hand, no checkpoint on
disk: ``RandomSource`` hands ``ModelSlice.load`` tensors drawn on the device, so loading, NF4
quantisation one layer at a time, capture and replay are sfchat's own code). For each model and
each segment count (1, and 2: each half cut into two segments on the one GPU, the code that runs a
half over two T4s), one node at a time:

* head node: the draft (0.5B shapes, dense, graphed as ``Drafter.capture`` does) and layers
  [0, L/2) with the embedding; graphs for the chain of K=8 and the 64-node tree (as
  ``loading.capture_graphs`` takes them); a context of ``--context`` tokens fed; timed per round:
  the draft's chain round and its tree, the head forward of 9 tokens and of the 65-node tree;
* tail node: layers [L/2, L) with norm and lm_head, graphs for the HELLO's two verify shapes;
  timed: the tail forward plus ``sampling.verify`` (chain) or ``verify_tree`` (tree);
* memory: what each node really peaks at (torch's peak reserved since it started loading, and
  the device's own used memory from ``mem_get_info``, which also sees graph executables) against
  the estimate of ``memory.head_plan`` / ``memory.tail_plan`` for the same layout;
* derived (not measured end to end): round = draft + head + tail + RTT, tok/s = tokens per round /
  round at 86 and 175 ms, with tokens per round assumed (``--chain-tokens``, ``--tree-tokens``:
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

from sfchat.engine import sampling, tree as trees  # noqa: E402
from sfchat.engine.draft import Drafter, scratch_slots, tree_shape  # noqa: E402
from sfchat.model.footprint import GIB, device_bytes  # noqa: E402
from sfchat.model.memory import DraftPlan, head_plan, tail_plan  # noqa: E402
from sfchat.model.slices import ModelSlice  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab): the public Qwen2.5 configs
    "32B": (5120, 27648, 64, 40, 8, 152064),
    "72B": (8192, 29568, 80, 64, 8, 152064),
    "tiny": (128, 256, 8, 4, 2, 512),
}
DRAFT = {"0.5B": (896, 4864, 24, 14, 2, 151936), "tiny": (128, 256, 2, 4, 2, 512)}
K, TREE = 8, 64
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


def head_node(cfg, dcfg, segments: int, device, dtype, context: int, n: int) -> tuple[dict, list[int]]:
    """Draft and head half on ``device``: figures, and the parents of a drafted tree (for the tail)."""
    L = cfg.num_hidden_layers
    max_len = context + 1 + scratch_slots(K, TREE, dcfg.vocab_size)
    width, _, nodes = tree_shape(TREE, K, dcfg.vocab_size)
    devices = [device] * segments
    draft_plan = DraftPlan(dcfg, device, dtype, "none", depths=(K,), tree_width=width, tree_depth=K,
                           tree_nodes=nodes)
    verifies = [(K + 1, False), (nodes + 1, True)]
    plan = head_plan(cfg, L // 2, devices=devices, dtype=dtype, quant="nf4", max_len=max_len, verifies=verifies,
                     draft=draft_plan)
    mem = Memory(device)
    t0 = time.perf_counter()
    dmodel = ModelSlice.load(RandomSource(dcfg, 2), 0, dcfg.num_hidden_layers, embed=True, head=True, dtype=dtype,
                             device=device, max_len=max_len)
    drafter = Drafter(dmodel, K, tree_budget=nodes, depths=(K,))
    head = ModelSlice.load(RandomSource(cfg, 1), 0, L // 2, embed=True, head=False, dtype=dtype, device=device,
                           max_len=max_len, quant="nf4", devices=devices)
    load_s = time.perf_counter() - t0
    mem.sample()
    graphed = device.type == "cuda"
    if graphed:
        drafter.capture()
        assert head.capture(K + 1) and head.capture(nodes + 1, tree=True), "a head graph could not be captured"
    tokens = [int(t) for t in torch.randint(0, dcfg.vocab_size, (context + 1,))]
    for start in range(0, context, 512):  # the context, as the head's prefill chunks
        piece = torch.tensor(tokens[start:min(start + 512, context)], device=device)
        head.run(piece, torch.arange(start, start + len(piece), device=device), end=start + len(piece))
    mem.sample()
    drafter.propose(tokens[:-1], GREEDY, None)  # the draft's catch-up: the timed rounds feed two tokens
    fig = {"load_s": load_s, "draft_chain_ms": timed(lambda: drafter.propose(tokens, GREEDY, None), device, n)}
    assert drafter.fed <= 2, "the timed draft round is not the steady-state one"
    grown = drafter.grow(tokens, GREEDY)
    fig["draft_tree_ms"] = timed(lambda: drafter.grow(tokens, GREEDY), device, n)
    v = context  # t0's position
    ids = torch.tensor(tokens[-1:] + tokens[:K], device=device)
    pos = torch.arange(v, v + K + 1, device=device)
    fig["head_chain_ms"] = timed(lambda: head.run(ids, pos, end=v + K + 1), device, n)
    frame = torch.tensor(tokens[-1:] + grown.tokens, device=device)
    slots = torch.arange(v, v + len(frame), device=device)
    mask = trees.mask(grown.parents, v, device)
    fig["head_tree_ms"] = timed(lambda: head.run(frame, slots, end=v + len(frame), tree=mask), device, n)
    fig.update(mem.figures())
    fig["estimate_gib"] = device_bytes(need for _, _, need in plan) / GIB
    fig["segments_placed"] = [list(r) for r in head.ranges]
    return fig, grown.parents


def tail_node(cfg, dcfg, segments: int, device, dtype, context: int, n: int, parents: list[int]) -> dict:
    L = cfg.num_hidden_layers
    max_len = context + 1 + scratch_slots(K, TREE, dcfg.vocab_size)
    m = len(parents) + 1
    verifies = [(K + 1, False), (m, True)]
    plan = tail_plan(cfg, L // 2, devices=[device] * segments, dtype=dtype, quant="nf4", max_len=max_len,
                     verifies=verifies)
    mem = Memory(device)
    t0 = time.perf_counter()
    tail = ModelSlice.load(RandomSource(cfg, 1), L // 2, L, embed=False, head=True, dtype=dtype, device=device,
                           max_len=max_len, quant="nf4", devices=[device] * segments)
    load_s = time.perf_counter() - t0
    mem.sample()
    if device.type == "cuda":
        for positions, is_tree in verifies:  # as the verifier captures a HELLO's shapes
            assert tail.capture(positions, positions, tree=is_tree), "a tail graph could not be captured"
    gen = torch.Generator(device=device).manual_seed(3)
    hidden = torch.randn(context + m, cfg.hidden_size, device=device, generator=gen).mul_(0.1).to(dtype)
    for start in range(0, context, 512):
        stop = min(start + 512, context)
        tail.run(hidden[start:stop], torch.arange(start, stop, device=device), 1, end=stop)
    mem.sample()
    v = context
    pos = torch.arange(v, v + K + 1, device=device)
    drafts = torch.arange(K)
    empty = torch.zeros(K, 0, device=device)

    def chain():
        return sampling.verify(tail.run(hidden[v:v + K + 1], pos, K + 1, end=v + K + 1), drafts, GREEDY, empty,
                               empty, None)

    slots = torch.arange(v, v + m, device=device)
    mask = trees.mask(parents, v, device)
    nodes = list(range(1, m))

    def tree():
        return sampling.verify_tree(tail.run(hidden[v:v + m], slots, m, end=v + m, tree=mask), parents, nodes,
                                    GREEDY, None)

    fig = {"load_s": load_s, "tail_chain_ms": timed(chain, device, n), "tail_tree_ms": timed(tree, device, n)}
    fig.update(mem.figures())
    fig["estimate_gib"] = device_bytes(need for _, _, need in plan) / GIB
    fig["segments_placed"] = [list(r) for r in tail.ranges]
    return fig


def derive(head: dict, tail: dict, rtts, chain_tokens: float, tree_tokens: float) -> dict:
    """tok/s from the measured compute and an assumed RTT and tokens per round (derived figures)."""
    out = {}
    for mode, tokens in (("chain", chain_tokens), ("tree", tree_tokens)):
        compute = head[f"draft_{mode}_ms"] + head[f"head_{mode}_ms"] + tail[f"tail_{mode}_ms"]
        out[f"{mode}_compute_ms"] = compute
        for rtt in rtts:
            out[f"{mode}_tok_s_{rtt}"] = tokens / (compute + rtt) * 1e3
    return out


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
    ap.add_argument("--chain-tokens", type=float, default=4.07, help="assumed tokens per chain round (K=8)")
    ap.add_argument("--tree-tokens", type=float, default=5.01, help="assumed tokens per tree round")
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
            head, parents = head_node(cfg, dcfg, segments, device, dtype, args.context, args.n)
            print(f"{name} x{segments} head node: {head}", flush=True)
            tail = tail_node(cfg, dcfg, segments, device, dtype, args.context, args.n, parents)
            print(f"{name} x{segments} tail node: {tail}", flush=True)
            results.append({"model": name, "segments": segments, "head": head, "tail": tail,
                            "derived": derive(head, tail, args.rtt, args.chain_tokens, args.tree_tokens)})
            if args.out:
                args.out.write_text(json.dumps({"device": where, "dtype": str(dtype), "results": results},
                                               indent=1))
    print_table(results, args.rtt)


def print_table(results: list[dict], rtts) -> None:
    print("\n| model | segments per half | draft ms chain / tree | head ms chain / tree | tail ms chain / tree "
          "| head node GiB: reserved, device, estimate | tail node GiB: reserved, device, estimate | "
          + " | ".join(f"tok/s at {r} ms chain / tree (derived)" for r in rtts) + " |")
    print("| --- " * (7 + len(rtts)) + "|")
    for r in results:
        h, t, d = r["head"], r["tail"], r["derived"]

        def mem(node):
            if "peak_reserved_gib" not in node:
                return f"-, -, {node['estimate_gib']:.2f}"
            return f"{node['peak_reserved_gib']:.2f}, {node['peak_device_gib']:.2f}, {node['estimate_gib']:.2f}"

        print(f"| {r['model']} | {r['segments']} | {h['draft_chain_ms']:.1f} / {h['draft_tree_ms']:.1f} | "
              f"{h['head_chain_ms']:.1f} / {h['head_tree_ms']:.1f} | {t['tail_chain_ms']:.1f} / "
              f"{t['tail_tree_ms']:.1f} | {mem(h)} | {mem(t)} | "
              + " | ".join(f"{d[f'chain_tok_s_{x}']:.1f} / {d[f'tree_tok_s_{x}']:.1f}" for x in rtts) + " |")


if __name__ == "__main__":
    main()
