"""GPU benchmark: token trees against the chain, per tree budget, through a real relay.

Random-weight bf16 checkpoints with the shapes of Qwen2.5-7B (target) and 0.5B (draft), depth
K=8, one GPU, the draft graphed (not compiled: one compile per budget would take minutes), a real
sfchat-relay on loopback per emulated RTT (0 and 86 ms by default), sealed, each with its own tail
process. For each tree budget (0 = today's chain of 8) one head engine is built against the RTT-0
tail and then the RTT-86 one, and measures:

  * build ms: the draft's part of a round (the chain's K steps, or growing the tree, the
    prompt-lookup branch and the graft), from the rounds' own clocks;
  * head fwd ms: the head half's forward of the verify frame alone (t0 + drafts, tree mask),
    replayed from its CUDA graph, timed with synchronisation over many calls;
  * head ms, tail ms: the rounds' own figures (head: forward, frame, send; tail: its compute as it
    reports it in each verdict: forward, lm_head, verification, moving the accepted path);
  * FORWARD bytes, and round ms at each RTT.

Random weights accept nothing, so tokens per round is ~1 here: this measures the cost of a tree;
what a tree buys is measured on a real pair by bench/tree_accept.py.

Run from the repository root:  python3 bench/tree_bench.py [--budgets 0,8,16,32,64,128] [--rounds 30]
Needs a CUDA GPU, torch, transformers, safetensors, websockets, cryptography and platformdirs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_bench  # noqa: E402
from gpu_bench import (GREEDY, QWEN25_05B, QWEN25_7B, TINY_DRAFT, TINY_TARGET, cuda_ms, engine_facing,  # noqa: E402
                       relay_and_tail, write_checkpoint)
from sfchat.config import Settings  # noqa: E402
from sfchat.engine import tree as trees  # noqa: E402

K = 8
PROMPT = list(range(200, 600))  # context ~400, as the figures


def steady(engine, n: int) -> list:
    engine.begin(PROMPT)
    engine.round(GREEDY, set(), 10 ** 6)  # prefill + one round: steady state from here
    return [engine.round(GREEDY, set(), 10 ** 6).stats for _ in range(n)]


def head_forward_ms(engine, budget: int, n: int) -> float:
    """The head half's verify forward alone at the current context: graph replay, synchronised."""
    head, rounds = engine.head, engine.rounds
    v = len(rounds.tokens) - 1
    m = (budget or K) + 1
    ids = torch.tensor(rounds.tokens[-1:] * m, device=head.device)
    pos = torch.arange(v, v + m, device=head.device)
    parents = [max(0, i - 1 - (i - 1) % 2) for i in range(1, m)]  # a binary-ish tree
    mask = trees.mask(parents, v, head.device) if budget else None
    return cuda_ms(lambda: head.run(ids, pos, end=v + m, tree=mask), n)


def tail_parts(target: Path, budgets: list[int], n: int) -> dict:
    """The tail half in this process, per budget: its verify forward alone (graph replay), with
    the verification (argmax and the walk, or the chain's prefix match), and the whole of what the
    tail does with a frame's payload (hidden states from bytes, the mask, forward, verification)."""
    from sfchat.engine import sampling
    from sfchat.model.slices import ModelSlice, n_layers
    from sfchat.model.source import ModelSource
    from sfchat.engine.verifier import tensor_from_bytes

    src = ModelSource.open(str(target))
    L = n_layers(src.config)
    dev = torch.device(gpu_bench.DEVICE)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tail = ModelSlice.load(src, L // 2, L, embed=False, head=True, dtype=dtype, device=dev, max_len=2048 + 300)
    H, ctx = src.config.hidden_size, len(PROMPT)
    tail.forward(torch.randn(ctx, H, device=dev, dtype=dtype), torch.arange(ctx, device=dev), 1)
    out = {}
    for budget in budgets:
        m = (budget or K) + 1
        if dev.type == "cuda":
            tail.capture(m, m, tree=bool(budget))
        hidden = torch.randn(m, H, device=dev, dtype=dtype)
        raw = hidden.view(torch.uint8).cpu().numpy().tobytes()
        pos = torch.arange(ctx - 1, ctx - 1 + m, device=dev)
        parents = [max(0, i - 1 - (i - 1) % 2) for i in range(1, m)]
        tokens = list(range(1, m))
        empty = torch.empty(m - 1, 0)

        def verify(h, mask):
            logits = tail.run(h, pos, m, end=ctx - 1 + m, tree=mask)
            if budget:
                return sampling.verify_tree(logits, parents, tokens, GREEDY, None)
            return sampling.verify(logits, torch.tensor(tokens), GREEDY, empty, empty, None)

        mask = trees.mask(parents, ctx - 1, dev) if budget else None
        out[budget] = {
            "fwd": cuda_ms(lambda: tail.run(hidden, pos, m, end=ctx - 1 + m, tree=mask), n),
            "fwd_verify": cuda_ms(lambda: verify(hidden, mask), n),
            "whole": cuda_ms(lambda: verify(tensor_from_bytes(raw, dtype, m, H, dev),
                                            trees.mask(parents, ctx - 1, dev) if budget else None), n),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="0,8,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--rtts", default="0,86")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    args = ap.parse_args()
    shapes = (TINY_TARGET, TINY_DRAFT) if args.smoke else (QWEN25_7B, QWEN25_05B)
    if args.smoke:
        gpu_bench.DEVICE = "cpu"
    budgets = [int(x) for x in args.budgets.split(",")]
    rtts = [int(x) for x in args.rtts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="sfchat-tree-bench-"))
    t0 = time.perf_counter()
    write_checkpoint(root / "target", shapes[0], seed=1)
    write_checkpoint(root / "draft", shapes[1], seed=2)
    print(f"checkpoints written in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    res: dict = {}
    with contextlib.ExitStack() as stack:
        urls = {rtt: stack.enter_context(relay_and_tail(rtt, root, f"rtt{rtt}")) for rtt in rtts}
        for budget in budgets:
            s = Settings(model=str(root / "target"), draft=str(root / "draft"), k=K, tree_budget=budget,
                         device=gpu_bench.DEVICE, max_context=2048, compile_draft=False, max_in_flight=1)
            engine = None
            row = res.setdefault(budget, {})
            for rtt in rtts:
                engine = engine_facing(s, urls[rtt], f"rtt{rtt}", engine)
                stats = steady(engine, args.rounds)

                def mean(attr):
                    return statistics.mean(getattr(r, attr) for r in stats)

                row[f"round_{rtt}"] = mean("round_ms")
                if rtt == rtts[0]:
                    row.update(build_ms=mean("draft_ms"), head_ms=mean("head_ms"), tail_ms=mean("tail_ms"),
                               forward_bytes=mean("forward_bytes"), depth=mean("depth"),
                               tokens_per_round=mean("committed"), rtt_ms=mean("rtt_ms"),
                               head_fwd_ms=head_forward_ms(engine, budget, 50))
                print(f"budget {budget} rtt {rtt}: {row[f'round_{rtt}']:.1f} ms", file=sys.stderr, flush=True)
            engine.link.close()
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    parts = tail_parts(root / "target", budgets, 50)
    for budget, p in parts.items():
        res[budget].update(tail_fwd_ms=p["fwd"], tail_verify_ms=p["fwd_verify"], tail_whole_ms=p["whole"])
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print_table(res, rtts)


def print_table(res: dict, rtts: list[int]) -> None:
    chain = res.get(0)

    def vs(r, key):
        return f"{r[key]:.2f} ({r[key] / chain[key]:.2f}x)" if chain else f"{r[key]:.2f}"

    print("| budget | build ms | head fwd ms | head ms | tail fwd ms | tail fwd + verify ms | tail whole ms "
          "| tail ms (reported) | FORWARD KiB | " + " | ".join(f"round ms @{r}" for r in rtts) + " |")
    print("|" + " --- |" * (9 + len(rtts)))
    for budget, r in res.items():
        print(f"| {budget or f'0 (chain of {K})'} | {r['build_ms']:.2f} | {vs(r, 'head_fwd_ms')} | {r['head_ms']:.2f} "
              f"| {vs(r, 'tail_fwd_ms')} | {vs(r, 'tail_verify_ms')} | {vs(r, 'tail_whole_ms')} | {vs(r, 'tail_ms')} "
              f"| {r['forward_bytes'] / 1024:.0f} | " + " | ".join(f"{r[f'round_{rtt}']:.1f}" for rtt in rtts) + " |")


if __name__ == "__main__":
    main()
