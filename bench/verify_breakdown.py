"""Where the time of a graphed forward goes: weights (GEMMs) against the attention window.

Builds random-weight slices with the shapes of Qwen2.5-7B (layers [0, 14), the head's half) and
Qwen2.5-0.5B (the whole draft) directly on the GPU (no checkpoint is written), captures their
CUDA graphs as the engine does (one per attention window of the static KV cache), then prints
one table:

  * the 9-token head-half forward (a K=8 verify) and the 1-token draft forward, replayed from
    the graph of the window that a context of each given length uses, and from the graph over
    all ``max_len`` slots (what every forward attended over before windows existed);
  * the same layers' matrix multiplications alone, captured back to back, and the bandwidth they
    reach (weight bytes / time);
  * the memory the graphs of all windows took;
  * the kernels that take the most time in one eager forward (torch.profiler).

Run from the repository root:  python3 bench/verify_breakdown.py [--tiny]   (--tiny: CPU, tiny shapes)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from bisect import bisect_left
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfchat.model.graphs import Graphed  # noqa: E402
from sfchat.model.kv import windows_for  # noqa: E402
from sfchat.model.slices import ModelSlice  # noqa: E402

SHAPES = {
    "7B head half": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, lo=0, hi=14, embed=False, head=False, tokens=9),
    "0.5B draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, lo=0, hi=24, embed=True, head=True, tokens=1),
}
TINY = {
    "tiny head half": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, lo=0, hi=2, embed=False, head=False, tokens=9),
    "tiny draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, lo=0, hi=2, embed=True, head=True, tokens=1),
}


def random_slice(shape: dict, dtype, device, max_len: int, rows: int | None = None) -> ModelSlice:
    from transformers import Qwen2Config

    shape = dict(shape)
    lo, hi, embed, head = shape.pop("lo"), shape.pop("hi"), shape.pop("embed"), shape.pop("head")
    shape.pop("tokens")
    cfg = Qwen2Config(rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, **shape)
    sl = ModelSlice(cfg, lo, hi, embed=embed, head=head, dtype=dtype, device=device, max_len=max_len, rows=rows)
    gen = torch.Generator(device=device).manual_seed(0)
    for module in sl.modules():  # every parameter is still on the meta device: make it real
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if "Norm" in type(module).__name__:
                t = torch.ones(p.shape, dtype=dtype, device=device)
            else:
                t = (torch.randn(p.shape, generator=gen, device=device) * 0.02).to(dtype)
            module._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    return sl.eval()


def timed(fn, n: int, cuda: bool) -> float:
    """Mean ms per call of ``fn`` over ``n`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def inputs(sl: ModelSlice, n_tok: int):
    if sl.embed_tokens is not None:
        return torch.zeros(n_tok, dtype=torch.long, device=sl.device)
    return torch.randn(n_tok, sl.config.hidden_size, device=sl.device).to(sl.dtype)


def forward_ms(sl: ModelSlice, n_tok: int, end: int | None, n: int, cuda: bool) -> float:
    """ms per ``run`` of an ``n_tok`` forward whose last position is ``end - 1`` (None: all slots)."""
    x = inputs(sl, n_tok)
    first = max((end if end is not None else sl.max_len) - n_tok, 0)
    end = end and first + n_tok
    pos = torch.arange(first, first + n_tok, device=sl.device)
    n_logits = 1 if sl.lm_head is not None else 0
    return timed(lambda: sl.run(x, pos, n_logits, end=end), n, cuda)


def gemm_ms(sl: ModelSlice, n_tok: int, n: int, cuda: bool) -> tuple[float, float]:
    """ms of the slice's linear layers alone (same weights, same M), and the GB they read."""
    weights = [m.weight for m in sl.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(n_tok, w.shape[1], device=sl.device).to(sl.dtype) for w in weights}

    def run():
        for w in weights:
            out = torch.nn.functional.linear(xs[w.shape[1]], w)
        return out  # a graph keeps (and hands back a copy of) what its function returns

    fn = run
    if cuda:
        fn = Graphed(lambda _: run(), (torch.zeros(1, device=sl.device),))
        fn = functools.partial(fn, torch.zeros(1, device=sl.device))
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    return timed(fn, n, cuda), gb


def profiled(forward, cuda: bool, width: int = 60) -> list[tuple[str, float, int]]:
    """(kernel name cut to ``width`` characters, total µs, calls) of one call of ``forward`` under
    torch's profiler, most expensive first: the GPU's kernels on CUDA, the aten ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        forward()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.cpu_time_total
        if us > 0 and (cuda or e.key.startswith("aten::")):
            rows.append((e.key[:width], us, e.count))
    return sorted(rows, key=lambda r: -r[1])


def top_kernels(sl: ModelSlice, n_tok: int, cuda: bool, top: int = 8) -> list[tuple[str, float, int]]:
    """(kernel name, total µs, calls) of one eager forward, most expensive first."""
    x = inputs(sl, n_tok)
    P = min(100, sl.max_len - n_tok)  # noqa: N806
    pos = torch.arange(P, P + n_tok, device=sl.device)
    n_logits = 1 if sl.lm_head is not None else 0
    sl.forward(x, pos, n_logits, sl.window_for(P + n_tok))
    return profiled(lambda: sl.forward(x, pos, n_logits, sl.window_for(P + n_tok)), cuda)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a quick check of the script")
    ap.add_argument("--max-len", type=int, default=8201, help="KV slots (the context size + K + 1)")
    ap.add_argument("--ends", type=int, nargs="*", default=[500, 2000, 4000, 8000],
                    help="context lengths at which to time the forward")
    ap.add_argument("--n", type=int, default=50, help="replays per figure")
    args = ap.parse_args()
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = TINY if args.tiny else SHAPES
    if args.tiny:
        from sfchat.model import kv

        kv.MIN_WINDOW = 8
    where = torch.cuda.get_device_name() if cuda else "cpu (tiny shapes)"
    print(f"{where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, {args.max_len} KV slots",
          flush=True)
    table, kernels = [], {}
    for label, shape in shapes.items():
        n_tok = shape["tokens"]
        t0 = time.perf_counter()
        sl = random_slice(shape, dtype, device, args.max_len)
        row = {"what": f"{label}, {n_tok} token{'s' * (n_tok > 1)}"}
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            sl.capture(n_tok, 1 if sl.lm_head is not None else 0)
            torch.cuda.synchronize()
            row["graph_mib"] = (torch.cuda.memory_allocated() - before) / 2 ** 20
        print(f"{label}: built and captured in {time.perf_counter() - t0:.1f} s; windows {sl.windows}",
              flush=True)
        for end in args.ends + [None]:
            row[end] = forward_ms(sl, n_tok, end, args.n, cuda)
            print(f"  context {end or 'all'}: {row[end]:.3f} ms", flush=True)
        row["gemm"], gb = gemm_ms(sl, n_tok, args.n, cuda)
        row["gbs"] = gb / row["gemm"] * 1e3
        row["gb"] = gb
        kernels[label] = top_kernels(sl, n_tok, cuda)
        table.append(row)
        del sl
        if cuda:
            torch.cuda.empty_cache()
    heads = [f"context {e} ({w})" for e, w in zip(args.ends, (windows_for(args.max_len)[bisect_left(
        windows_for(args.max_len), e)] for e in args.ends))]
    print("\n| graphed forward | " + " | ".join(f"{h} slots" for h in heads)
          + f" | all {args.max_len} slots | GEMMs alone | GEMM GB/s (GB read) | graphs MiB |")
    print("| --- |" + " --- |" * (len(args.ends) + 4))
    for row in table:
        print(f"| {row['what']} | " + " | ".join(f"{row[e]:.3f} ms" for e in args.ends + [None])
              + f" | {row['gemm']:.3f} ms | {row['gbs']:.0f} ({row['gb']:.2f}) | {row.get('graph_mib', 0):.0f} |")
    for label, rows in kernels.items():
        print(f"\nTop kernels, one eager forward of the {label} (context 100):")
        for name, us, count in rows:
            print(f"  {us:9.1f} us  x{count:<4} {name}")


if __name__ == "__main__":
    main()
