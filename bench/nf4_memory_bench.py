"""GPU check of 4-bit loading and of the memory estimate, at the shapes of Qwen2.5-7B and 0.5B.

Writes random-weight bf16 checkpoints with those shapes (as ``gpu_bench.py`` does), then for the
head slice, the tail slice and the draft, dense and NF4, prints one table: the estimate of
``sfchat.model.memory.slice_need`` next to what torch really allocated after loading, and the
peak after a 512-token prefill chunk, the K+1 verify and the CUDA-graph capture; whether the
capture worked with bitsandbytes and is bit-identical to eager; and the graphed verify (or draft
round) time.

Run from the repository root:  python3 bench/nf4_memory_bench.py [--k 8] [--dtype float16]
Needs a CUDA GPU, torch, transformers, safetensors, bitsandbytes (and websockets, platformdirs).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_bench import QWEN25_05B, QWEN25_7B, write_checkpoint  # noqa: E402
from sfchat.engine.draft import Drafter  # noqa: E402
from sfchat.model.footprint import GIB, slice_need  # noqa: E402
from sfchat.model.graphs import GraphTable  # noqa: E402
from sfchat.model.memory import DraftPlan, draft_need  # noqa: E402
from sfchat.model.slices import ModelSlice  # noqa: E402
from sfchat.model.source import ModelSource  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

DEV = torch.device("cuda")


def ms(fn, n=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def measure(name, src, lo, hi, embed, head, quant, dtype, k, ctx):
    gc.collect()
    torch.cuda.empty_cache()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if embed and head:  # the draft, with the graphs of its K-step round and its guess step
        est = draft_need(DraftPlan(src.config, DEV, dtype, quant, depths=(k,)), ctx)
    else:
        est = slice_need(src.config, lo, hi, embed=embed, head=head, dtype=dtype, quant=quant, max_len=ctx,
                         verifies=[(k + 1, False)])
    sl = ModelSlice.load(src, lo, hi, embed=embed, head=head, dtype=dtype, device=DEV, max_len=ctx, quant=quant)
    load_s = time.perf_counter() - t0
    loaded = torch.cuda.memory_allocated() - base
    row = {"slice": name, "quant": quant, "est weights+kv GiB": (est.weights + est.kv) / GIB,
           "loaded GiB": loaded / GIB, "load s": load_s}
    logs = []
    n = 512
    if embed:
        x = torch.randint(0, src.config.vocab_size, (n,), device=DEV)
    else:
        x = torch.randn(n, src.config.hidden_size, dtype=dtype, device=DEV)
    if embed and head:  # the draft: its K-step round, captured before any context as the engine does
        drafter = Drafter(sl, k)
        row["graphed"] = drafter.capture(log=logs.append)
        graphs, drafter.graphs = drafter.graphs, GraphTable()
        tokens = list(range(100, 100 + n + 1))
        drafter.propose(tokens[:-1], Sampling(), None)  # the prefill
        eager = drafter.propose(tokens, Sampling(), None)[0]
        drafter.graphs = graphs
        again = drafter.propose(tokens, Sampling(), None)[0]  # same context, now replayed
        row["bit-identical"] = again == eager if graphs else "-"
        row["ms"] = ms(lambda: drafter.propose(tokens, Sampling(), None))
    else:
        nl = k + 1 if head else 0
        row["graphed"] = sl.capture(k + 1, nl, log=logs.append)
        sl.forward(x, torch.arange(n, device=DEV), 1 if head else 0)  # one prefill chunk
        xs, pos = x[: k + 1], torch.arange(n, n + k + 1, device=DEV)
        eager = sl.forward(xs, pos, nl).clone()
        row["bit-identical"] = torch.equal(sl.run(xs, pos, nl), eager) if row["graphed"] else "-"
        row["ms"] = ms(lambda: sl.run(xs, pos, nl))
    torch.cuda.synchronize()
    row["est total GiB"] = est.total / GIB
    row["peak GiB"] = (torch.cuda.max_memory_allocated() - base) / GIB
    # a graph pool's free blocks are reserved, not allocated: this is what the GPU really gives up
    row["peak reserved GiB"] = (torch.cuda.max_memory_reserved() - base_reserved) / GIB
    row["note"] = "; ".join(m[:90] for m in logs)
    return row  # the slice goes with this frame: the next measurement starts from empty


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ctx = args.ctx + args.k + 1
    root = Path(tempfile.mkdtemp(prefix="sfchat-nf4-"))
    t = time.perf_counter()
    write_checkpoint(root / "target", QWEN25_7B, seed=1)
    write_checkpoint(root / "draft", QWEN25_05B, seed=2)
    print(f"checkpoints written in {time.perf_counter() - t:.0f} s", flush=True)
    target, draft = ModelSource.open(str(root / "target")), ModelSource.open(str(root / "draft"))
    L, split = 28, 14
    rows = []
    for quant in ("none", "nf4"):
        rows.append(measure("7B head [0,14)", target, 0, split, True, False, quant, dtype, args.k, ctx))
        rows.append(measure("7B tail [14,28)", target, split, L, False, True, quant, dtype, args.k, ctx))
        rows.append(measure("0.5B draft", draft, 0, 24, True, True, quant, dtype, args.k, ctx))
        for r in rows[-3:]:
            print(r, flush=True)
    keys = ["slice", "quant", "est weights+kv GiB", "loaded GiB", "est total GiB", "peak GiB", "peak reserved GiB",
            "graphed",
            "bit-identical", "ms", "load s"]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, K={args.k}, "
          f"context {ctx} slots\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if r["note"]:
            print(f"{r['slice']} {r['quant']}: {r['note']}")


if __name__ == "__main__":
    main()
