"""One decoder layer's four linears (q, k, gate+up, down) of the 32B and 72B shapes at 1-129 rows,
stored each way a slice can hold them, on one GPU: what does a frame's matmul cost against the
weight read?

  python3 bench/quant_rows.py [--models 32B 72B] [--rows 1 9 17 33 65 129] [--out FILE.json]

Ways timed (30 calls each, CUDA events; "graph" = the same four calls replayed from a CUDA graph):
  fp16         dense fp16 weights, F.linear
  nf4          bitsandbytes Linear4bit (NF4, blocks of 64, double quantisation) as it dispatches
               itself: its fused 4-bit GEMM or dequantize + F.linear, by its per-GPU table
  nf4-fused    the same weights through the fused 4-bit GEMM at every row count
  nf4-dequant  the same weights dequantised to fp16 each call, then F.linear
  int8         bitsandbytes Linear8bitLt, threshold 0 (int8 weights per output row, int8 rows of
               the input per row, cuBLASLt int8 GEMM): the graphable 8-bit path
  int8-outl    the same with threshold 6 (outlier columns of the input kept in fp16: eager only)
Floors: the weights' bytes over the measured copy bandwidth. Error: each way's output against the
fp16 output on inputs with 4 outlier columns (x20), relative to the fp16 output's RMS.
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {"32B": [(5120, 5120), (5120, 1024), (5120, 27648 * 2), (27648, 5120)],
          "72B": [(8192, 8192), (8192, 1024), (8192, 29568 * 2), (29568, 8192)]}


def bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), n=10)
    del x, y
    return 2 * 2 * 1024**3 / (ms / 1e3)


def timed(fn, n=30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def graphed(fn):
    """``fn`` captured once; returns the replay, or the capture's error."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc)[:80]}"
    return g.replay


def build(model: str):
    import bitsandbytes as bnb
    from torch import nn

    ways = {"fp16": [], "nf4": [], "int8": [], "int8-outl": []}
    for i, o in SHAPES[model]:
        w = torch.randn(o, i, dtype=torch.float16, device="cuda") * 0.02
        dense = nn.Linear(i, o, bias=False, device="meta")
        dense.weight = nn.Parameter(w, requires_grad=False)
        ways["fp16"].append(dense)
        q4 = bnb.nn.Linear4bit(i, o, bias=False, compute_dtype=torch.float16, compress_statistics=True,
                               quant_type="nf4", device="meta")
        q4.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, blocksize=64, compress_statistics=True,
                                      quant_type="nf4", module=q4).to("cuda")
        ways["nf4"].append(q4)
        for name, thr in (("int8", 0.0), ("int8-outl", 6.0)):
            q8 = bnb.nn.Linear8bitLt(i, o, bias=False, has_fp16_weights=False, threshold=thr, device="meta")
            q8.weight = bnb.nn.Int8Params(w.cpu().clone(), requires_grad=False, has_fp16_weights=False)
            ways[name].append(q8.to("cuda"))
        del w
    return ways


def forced(layer, custom: bool):
    from bitsandbytes.backends.cuda import ops

    qs = layer.weight.quant_state
    args = (layer.weight.data.view(-1, 1), qs.shape, qs.state2.absmax, qs.blocksize, qs.quant_type)
    kw = dict(bias=None, absmax_8bit=qs.absmax, absmax_code=qs.state2.code, absmax_offset=qs.offset)
    impl = ops._gemm_4bit_kernel_impl if custom else ops._dequant_linear_fallback
    return lambda x: impl(x, *args, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["32B", "72B"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 9, 17, 33, 65, 129])
    ap.add_argument("--out")
    args = ap.parse_args()
    from bitsandbytes.backends.cuda import ops

    torch.manual_seed(0)
    bw = bandwidth()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} (cc {props.major}.{props.minor}): copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")
    rows_out = []
    for model in args.models:
        ways = build(model)
        ways["nf4-fused"] = [forced(q, True) for q in ways["nf4"]]
        ways["nf4-dequant"] = [forced(q, False) for q in ways["nf4"]]
        weights = sum(i * o for i, o in SHAPES[model])
        floor4, floor8 = weights / 2 / (bw / 2) * 1e3, weights / (bw / 2) * 1e3
        print(f"\n{model}: one layer's linears, ms (eager / graph); 4-bit floor {floor4:.3f} ms, 8-bit {floor8:.3f}")
        names = ["fp16", "nf4", "nf4-fused", "nf4-dequant", "int8", "int8-outl"]
        print("| rows | nf4 picks | " + " | ".join(names) + " | nf4 / floor | error " + " ".join(names[1:]) + " |")
        print("| --- " * (len(names) + 4) + "|")
        for rows in args.rows:
            xs = [torch.randn(rows, i, dtype=torch.float16, device="cuda") for i, _ in SHAPES[model]]
            for x in xs:
                x[:, :4] *= 20
            picks = "".join("F" if ops._gemm_4bit_use_custom_cuda(0, torch.float16, rows, o, i) else "D"
                            for i, o in SHAPES[model])
            ref = [l(x) for l, x in zip(ways["fp16"], xs)]
            rms = [r.float().pow(2).mean().sqrt() for r in ref]
            cells, errs, record = [], [], {"model": model, "rows": rows, "picks": picks,
                                           "floor4_ms": floor4, "floor8_ms": floor8}
            with torch.no_grad():
                for name in names:
                    layers = ways[name]
                    fn = lambda: [l(x) for l, x in zip(layers, xs)]  # noqa: E731
                    eager = timed(fn)
                    g = graphed(fn) if name != "int8-outl" else "not tried"
                    graph = timed(g) if callable(g) else None
                    cells.append(f"{eager:.3f} / " + (f"{graph:.3f}" if graph is not None else "-"))
                    record[name] = {"eager_ms": eager, "graph_ms": graph, "graph_error": None if callable(g) else g}
                    if name != "fp16":
                        out = [l(x) for l, x in zip(layers, xs)]
                        e = max(((a.float() - b.float()).pow(2).mean().sqrt() / r).item()
                                for a, b, r in zip(out, ref, rms))
                        errs.append(f"{e:.3f}")
                        record[name]["rel_err"] = e
                    torch.cuda.synchronize()
            print(f"| {rows} | {picks} | " + " | ".join(cells)
                  + f" | {record['nf4']['eager_ms'] / floor4:.1f}x | " + " ".join(errs) + " |", flush=True)
            rows_out.append(record)
        del ways
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": props.name, "bandwidth": bw, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
