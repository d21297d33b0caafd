"""What one row shape costs a forward (issue 46): the head's and the tail's slice of a target, one
verify forward each, replayed from its CUDA graph, timed with CUDA events.

Variants, each at the context length ``--context`` (the committed positions the rows attend over):
* ``plain R``: every forward at its own row count R (``--frame-rows 0``): transformers' SDPA over
  a tree mask, the scratch of ``--pool`` slots;
* ``one shape``: every forward at ``--rows`` rows, canonical attention (``kv.Attend``), plain torch;
* ``one shape, compiled``: the same with ``--compile-attention``.

A frame of ``nodes`` nodes is a chain (each node the child of the one before); ``--profile`` adds the
kernel count per forward and the kernels that take the most time (torch.profiler), ``--prompt N`` a
prefill of N positions in the slice's pieces. Prints a table; ``--save`` writes it as JSON. Needs a
GPU (a CPU run is a smoke test of the script only). Beside `bench/frame_cost.py` (the head's half:
the draft step, tree frames at their own sizes and the 64-row frame over growing contexts), this
one puts the head's and the tail's half (its lm_head included) side by side at one chain, padded
or not, and times the prefill, the forward no graph used to replay.

    python3 bench/shape_cost.py --self 1.5b --dtype bfloat16 --context 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
from harness import QWEN25_05B, QWEN25_7B, QWEN25_15B, TINY_TARGET  # noqa: E402
from sfchat.engine.scratch import Scratch  # noqa: E402
from sfchat.model import attention  # noqa: E402
from sfchat.model.decoder import n_layers  # noqa: E402
from sfchat.model.kv import PREFILL_CHUNK  # noqa: E402
from sfchat.model.devices import DTYPES  # noqa: E402
from sfchat.model.slices import ModelSlice  # noqa: E402
from sfchat.model.source import ModelSource  # noqa: E402

SHAPES = {"tiny": TINY_TARGET, "0.5b": QWEN25_05B, "1.5b": QWEN25_15B, "7b": QWEN25_7B}


def load(src: ModelSource, tail: bool, dev, dtype, max_len: int, rows: int | None) -> ModelSlice:
    L = n_layers(src.config)
    lo, hi = (L // 2, L) if tail else (0, L // 2)
    return ModelSlice.load(src, lo, hi, embed=not tail, head=tail, dtype=dtype, device=dev, max_len=max_len,
                           rows=rows)


def context(model: ModelSlice, n: int, dev) -> None:
    """The slice's first ``n`` positions written from seeded inputs (the same for every variant)."""
    gen = torch.Generator().manual_seed(1)
    if model.embed_tokens is not None:
        x = torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(dev)
    else:
        x = torch.randn(n, model.config.hidden_size, generator=gen).to(dev, model.dtype)
    model.feed(x, 0)
    model.note(0, [0] * n)


def chain_inputs(model: ModelSlice, n: int, nodes: int, shape: int, pool: int, dev):
    """A chain of ``nodes`` seeded nodes after ``n`` positions, padded to ``shape`` rows."""
    scratch = Scratch(model, pool)
    scratch.reset(n)
    rows = [(n + i, i, list(range(i))) for i in range(nodes)]
    slots, mask = scratch.tree_inputs(rows, shape, dev)
    gen = torch.Generator().manual_seed(2)
    if model.embed_tokens is not None:
        x = torch.randint(0, model.config.vocab_size, (shape,), generator=gen)
    else:
        x = torch.randn(shape, model.config.hidden_size, generator=gen)
    x[nodes:] = 0
    x = x.to(dev, torch.long if model.embed_tokens is not None else model.dtype)
    return x, slots, mask, scratch.reach


def timed(fn, reps: int, cuda: bool) -> float:
    """The median ms of ``fn()`` over ``reps`` calls, after a few unmeasured."""
    for _ in range(3):
        fn()
    if not cuda:
        import time
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def kernels(fn, top: int) -> tuple[int, list[tuple[str, float]]]:
    """Kernels launched by one ``fn()`` and the ``top`` of them by total GPU time (ms)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by: dict[str, float] = {}
    for e in events:
        by[e.name] = by.get(e.name, 0.0) + e.device_time / 1e3
    return len(events), sorted(by.items(), key=lambda kv: -kv[1])[:top]


def measure(model: ModelSlice, name: str, tail: bool, args, dev, cuda: bool, shape: int, nodes: int,
            outs: dict) -> dict:
    """One variant's forward of a chain of ``nodes`` at ``shape`` rows: its median ms and, against
    the first variant's rows for that chain (``outs``), the largest difference of its real rows."""
    n_logits = shape if tail else 0
    span = args.pool
    if cuda and not model.captured(shape, n_logits, tree=True):
        model.capture(shape, n_logits, tree=True, span=span)
    x, slots, mask, reach = chain_inputs(model, args.context, nodes, shape, args.pool, dev)

    def fn():
        return model.run(x, slots, n_logits, end=reach, tree=mask)
    ms = timed(fn, args.reps, cuda)
    mine = fn()[:nodes].float().cpu()  # the replays wrote the same slots: the same again
    ref = outs.setdefault((tail, nodes), mine)
    row = {"variant": name, "slice": "tail" if tail else "head", "rows": shape, "nodes": nodes, "ms": ms,
           "captured": model.captured(shape, n_logits, tree=True), "diff": (mine - ref).abs().max().item()}
    if args.profile and cuda:
        row["kernels"], row["top"] = kernels(fn, args.top)
    return row


def prefill(model: ModelSlice, name: str, tail: bool, args, dev, cuda: bool) -> dict:
    """A prompt of ``--prompt`` positions written after the context (pieces of the slice's rows, or
    of ``PREFILL_CHUNK`` without one): its median ms."""
    gen = torch.Generator().manual_seed(3)
    if model.embed_tokens is not None:
        x = torch.randint(0, model.config.vocab_size, (args.prompt,), generator=gen).to(dev)
    else:
        x = torch.randn(args.prompt, model.config.hidden_size, generator=gen).to(dev, model.dtype)
    ms = timed(lambda: model.feed(x, args.context), max(3, args.reps // 5), cuda)
    return {"variant": name, "slice": "tail" if tail else "head", "rows": model.rows or PREFILL_CHUNK,
            "nodes": args.prompt, "ms": ms, "captured": None, "diff": 0.0, "prefill": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self", dest="shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=1024, help="committed positions before the frame")
    ap.add_argument("--rows", type=int, default=64, help="the one row count")
    ap.add_argument("--plain-rows", default="1,9,64", help="the row counts of the plain forwards")
    ap.add_argument("--pool", type=int, default=65, help="scratch slots (a frame's and the trash slot)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=0, help="also time a prefill of N positions (0: none)")
    ap.add_argument("--variants", default="plain,one,compiled")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    cuda = dev.type == "cuda"
    variants = args.variants.split(",")
    plain_rows = [int(r) for r in args.plain_rows.split(",")]
    max_len = args.context + max(args.pool, args.prompt) + 512
    results, outs = [], {}
    harness.DEVICE = args.device
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "target"
        harness.write_checkpoint(path, SHAPES[args.shape], seed=0)
        src = ModelSource.open(str(path))
        for tail in (False, True):
            if "plain" in variants:
                model = load(src, tail, dev, dtype, max_len, None)
                context(model, args.context, dev)
                for r in plain_rows:
                    results.append(measure(model, f"plain {r}", tail, args, dev, cuda, r, r, outs))
                if args.prompt:
                    results.append(prefill(model, "plain", tail, args, dev, cuda))
                del model
            for v in ("one", "compiled"):
                if v not in variants:
                    continue
                attention.compile_on_gpu(v == "compiled")
                model = load(src, tail, dev, dtype, max_len, args.rows)
                context(model, args.context, dev)
                for r in plain_rows:
                    results.append(measure(model, "one shape" + (", compiled" if v == "compiled" else ""), tail,
                                           args, dev, cuda, args.rows, min(r, args.rows), outs))
                if args.prompt:
                    results.append(prefill(model, "one shape" + (", compiled" if v == "compiled" else ""), tail,
                                           args, dev, cuda))
                del model
            if cuda:
                torch.cuda.empty_cache()
    print("| slice | variant | rows (nodes) | ms a forward | kernels | real rows against the first variant's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        what = f"prefill of {r['nodes']} in pieces of {r['rows']}" if r.get("prefill") else f"{r['rows']} ({r['nodes']})"
        print(f"| {r['slice']} | {r['variant']} | {what} | {r['ms']:.3f} | {r.get('kernels', '')} "
              f"| {r['diff']:.2e} |")
    for r in results:
        if r.get("top"):
            print(f"\n{r['slice']} {r['variant']} {r['rows']} ({r['nodes']}): "
                  + "; ".join(f"{n[:60]} {t:.3f}" for n, t in r["top"]))
    if args.save:
        args.save.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
