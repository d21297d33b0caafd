"""What a pair of 2xT4 notebooks would do: a DERIVED table (nothing here ran on a T4).

Per model and storage, per frame size (one frame per round trip: a chain of 8, or a tree of
15 / 31 / 63 drafts and the root), each node's time per frame on T4s is a roofline:

  max(bytes read / BANDWIDTH, multiply-adds x 2 / THROUGHPUT) + LAUNCH_US per kernel

bytes read = the node's stored linear weights (fp16, NF4 at 0.516 bytes, int8 at ~1 byte) plus
the tail's 16-bit lm_head plus the K/V of ``--context`` tokens; the multiply-adds are those of the
linears, the lm_head and attention over the context at the frame's rows. A node's two T4s run its
two segments one after the other, so the node reads its half at one T4's bandwidth. The inputs:

* the T4's published figures: 320 GB/s, 65 TFLOPS fp16 with tensor cores, 130 TOPS int8; taken at
  ``EFFICIENCY`` of peak (a T4 sustains about three quarters of its bandwidth and, capped at 70 W,
  about half its tensor-core peak);
* bitsandbytes 0.50's fused 4-bit GEMM on a T4 (fp16 MMA, up to 64 rows for these shapes:
  bench/RESULTS.md, 2026-12-06 second session) taken at the fp16 rate and its weight read
  ("nf4"), or at twice that read ("nf4 at 2x"): not measured on a T4, so both are shown;
* the draft: 25 ms for 8 CUDA-graphed steps of the 0.5B draft on a T4 (measured by the system
  that inspired sfchat, DESIGN.md);
* tokens per verdict at each frame size: ``bench/tree_accept.py`` on the SmolLM2 pair (round4
  draft, greedy, 12 prompts x 48 tokens, CPU), 2026-12-06: chain 3.22, tree 15 3.57, 31 4.02,
  63 4.37;
* the link: the RTT and ``--mbps`` (default 100) for the frame's hidden states (rows x hidden x 2).

tok/s = tokens per verdict / (draft + head + transfer + tail + RTT). Frames in flight are not
derived here (see bench/pipeline_sim.py for what they add at a given cost).

Run:  python3 bench/t4_derived.py [--context 2048] [--mbps 100]   (CPU, instant)
"""

from __future__ import annotations

import argparse

BANDWIDTH, FP16_OPS, INT8_OPS = 320e9, 65e12, 130e12  # T4, published
EFFICIENCY = dict(bandwidth=0.75, mma=0.5)
LAUNCH_US, KERNELS_PER_LAYER = 5.0, 15
DRAFT_MS = 25.0  # K=8 graphed draft steps on a T4 (the inspiring system's measurement)
TOKENS = {9: 3.22, 16: 3.57, 32: 4.02, 64: 4.37}  # rows per frame -> tokens per verdict (tree_accept)
NF4 = 0.5 + 1 / 64 + 4 / (64 * 256)
# "nf4 at 2x": the fused kernel at twice its weight read (on the H100 it ran at 4.4x at 9 rows,
# where HBM makes reads cheap; bitsandbytes reports it up to 4x faster than dequantise + GEMM on
# Turing, whose bound is ~9x): which side of int8 NF4 lands on a T4 depends on it
BYTES = {"fp16": 2.0, "nf4": NF4, "nf4 at 2x": 2 * NF4, "int8": 1.0 + 4 / 5120}
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "7B": (3584, 18944, 28, 28, 4, 152064),
    "32B": (5120, 27648, 64, 40, 8, 152064),
    "72B": (8192, 29568, 80, 64, 8, 152064),
}
MODELS = [("7B", "fp16"), ("32B", "nf4"), ("32B", "nf4 at 2x"), ("32B", "int8"), ("72B", "nf4"), ("72B", "nf4 at 2x")]


def node_ms(model: str, storage: str, rows: int, context: int, tail: bool) -> float:
    H, inter, L, heads, kv, V = SHAPES[model]
    hd = H // heads
    layers = L // 2
    linear = H * (H + 2 * kv * hd) + heads * hd * H + 3 * H * inter  # q, k, v, o, gate, up, down
    read = layers * linear * BYTES[storage] + layers * 2 * context * kv * hd * 2 + (V * H * 2 if tail else 0)
    macs_lin = rows * (layers * linear + (V * H if tail else 0))
    macs_attn = layers * 2 * rows * context * heads * hd
    ops = INT8_OPS if storage == "int8" else FP16_OPS
    mma = ops * EFFICIENCY["mma"]
    compute = 2 * macs_lin / mma + 2 * macs_attn / (FP16_OPS * EFFICIENCY["mma"])
    memory = read / (BANDWIDTH * EFFICIENCY["bandwidth"])
    return (max(memory, compute) + layers * KERNELS_PER_LAYER * LAUNCH_US / 1e6) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--mbps", type=float, default=100.0)
    ap.add_argument("--rtts", type=int, nargs="*", default=[86, 175])
    args = ap.parse_args()
    print(f"DERIVED for two notebooks of 2xT4, context {args.context}, link {args.mbps:g} Mbit/s "
          f"(T4 at {EFFICIENCY['bandwidth']:.0%} of 320 GB/s, {EFFICIENCY['mma']:.0%} of its tensor-core peak)")
    print("\n| model | weights | frame rows | head ms | tail ms | frame KiB | tokens per verdict | "
          + " | ".join(f"tok/s at {r} ms" for r in args.rtts) + " |")
    print("| --- " * (7 + len(args.rtts)) + "|")
    for model, storage in MODELS:
        H = SHAPES[model][0]
        best = {}
        for rows, tokens in TOKENS.items():
            head, tail = node_ms(model, storage, rows, args.context, False), node_ms(model, storage, rows,
                                                                                      args.context, True)
            kib = rows * H * 2 / 1024
            xfer = rows * H * 2 * 8 / (args.mbps * 1e6) * 1e3 if args.mbps else 0.0
            rates = [tokens / (DRAFT_MS + head + xfer + tail + rtt) * 1e3 for rtt in args.rtts]
            for rtt, rate in zip(args.rtts, rates):
                best[rtt] = max(best.get(rtt, (0, 0)), (rate, rows))
            print(f"| {model} | {storage} | {rows} | {head:.0f} | {tail:.0f} | {kib:.0f} | {tokens:.2f} | "
                  + " | ".join(f"{x:.1f}" for x in rates) + " |")
        print(f"| {model} | {storage} | best | | | | | "
              + " | ".join(f"**{best[r][0]:.1f}** ({best[r][1]} rows)" for r in args.rtts) + " |")


if __name__ == "__main__":
    main()
