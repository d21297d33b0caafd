"""GPU benchmark: the sequential round against the round prepared under the wait, through a real relay.

Random-weight bf16 checkpoints with the shapes of Qwen2.5-7B (target) and 0.5B (draft), K=8, one
GPU; a real sfchat-relay on loopback per emulated RTT (0, 30, 86 ms by default), each with its
own tail process, sealed end to end as relay mode is by default. For each RTT and each draft, the
same head engine runs ``--rounds`` rounds with ``prepare=off`` (sequential: draft, head, send,
wait) and with ``prepare=auto`` (the next round drafted under the wait when the measured wait
pays for it). Two drafts:

  * the random 0.5B draft: it never agrees with the target, so every prepared outcome misses
    (what preparing costs when it cannot help);
  * draft = target (the 7B checkpoint drafting for itself, graphed, not compiled): full
    acceptance, so the prepared outcome is the real one (what it buys when it hits).

Prints one table: round ms (all, hit rounds, miss rounds and the slowest miss), wait, overlap,
rtt, hit rate, tokens per round, tok/s measured, and tok/s derived at 4.07 tokens per round (the
reference pair's acceptance) from the miss rounds.

Run from the repository root:  python3 bench/prepare_bench.py [--rounds 40] [--rtts 0,30,86]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_bench  # noqa: E402
from gpu_bench import (GREEDY, QWEN25_05B, QWEN25_7B, TINY_DRAFT, TINY_TARGET, engine_facing,  # noqa: E402
                       relay_and_tail, write_checkpoint)
from sfchat.config import Settings  # noqa: E402
from sfchat.runtime.policy import PreparePolicy  # noqa: E402

K = 8
PROMPT = list(range(200, 328))


def measure(engine, mode: str, n: int) -> dict:
    engine.prepare_mode = mode
    engine.policy = PreparePolicy()  # each mode learns from scratch
    engine.begin(PROMPT)
    engine.round(GREEDY, set(), 10 ** 6)  # prefill (or reuse) + one round: steady state from here
    stats = [engine.round(GREEDY, set(), 10 ** 6).stats for _ in range(n)]
    hits = [r.round_ms for r in stats if r.prepared]
    misses = [r.round_ms for r in stats if not r.prepared]

    def mean(attr):
        return statistics.mean(getattr(r, attr) for r in stats)

    return {"round_ms": mean("round_ms"), "hit_ms": statistics.mean(hits) if hits else None,
            "miss_ms": statistics.mean(misses) if misses else None, "max_miss_ms": max(misses, default=None),
            "wait_ms": mean("wait_ms"), "overlap_ms": mean("overlap_ms"), "rtt_ms": mean("rtt_ms"),
            "draft_ms": mean("draft_ms"), "head_ms": mean("head_ms"), "tail_ms": mean("tail_ms"),
            "hit_rate": len(hits) / len(stats), "tokens_per_round": mean("committed"),
            "tps": sum(r.committed for r in stats) / (sum(r.round_ms for r in stats) / 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--rtts", default="0,30,86")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    args = ap.parse_args()
    shapes = (TINY_TARGET, TINY_DRAFT) if args.smoke else (QWEN25_7B, QWEN25_05B)
    if args.smoke:
        gpu_bench.DEVICE = "cpu"
    rtts = [int(x) for x in args.rtts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="sfchat-prepare-bench-"))
    t0 = time.perf_counter()
    write_checkpoint(root / "target", shapes[0], seed=1)
    write_checkpoint(root / "draft", shapes[1], seed=2)
    print(f"checkpoints written in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    drafts = {"random 0.5B": (root / "draft", True), "draft = target": (root / "target", False)}
    res: dict = {}
    with contextlib.ExitStack() as stack:
        urls = {rtt: stack.enter_context(relay_and_tail(rtt, root, f"rtt{rtt}")) for rtt in rtts}
        for name, (draft, compiled) in drafts.items():
            s = Settings(model=str(root / "target"), draft=str(draft), k=K, device=gpu_bench.DEVICE, max_context=2048,
                         compile_draft=compiled)
            engine = None
            for rtt in rtts:
                engine = engine_facing(s, urls[rtt], f"rtt{rtt}", engine)
                for mode in ("off", "auto"):
                    res[f"{rtt}|{name}|{mode}"] = measure(engine, mode, args.rounds)
                    print(f"rtt {rtt} {name} {mode}: {res[f'{rtt}|{name}|{mode}']['round_ms']:.1f} ms",
                          file=sys.stderr, flush=True)
            engine.link.close()
            del engine
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print_table(res)


def print_table(res: dict) -> None:
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    print("| RTT | draft | mode | round ms | hit rounds | miss rounds | slowest miss | wait | overlap | rtt "
          "| draft | head | tail | hit rate | tokens/round | tok/s | tok/s @4.07 |")
    print("|" + " --- |" * 17)
    for key, r in res.items():
        rtt, name, mode = key.split("|")
        derived = 4.07e3 / r["miss_ms"] if r["miss_ms"] else None
        print(f"| {rtt} | {name} | {'sequential' if mode == 'off' else 'prepared (auto)'} | {f(r['round_ms'])} "
              f"| {f(r['hit_ms'])} | {f(r['miss_ms'])} | {f(r['max_miss_ms'])} | {f(r['wait_ms'])} "
              f"| {f(r['overlap_ms'])} | {f(r['rtt_ms'])} | {f(r['draft_ms'])} | {f(r['head_ms'])} "
              f"| {f(r['tail_ms'])} | {f(r['hit_rate'], '{:.2f}')} | {f(r['tokens_per_round'], '{:.2f}')} "
              f"| {f(r['tps'])} | {f(derived)} |")


if __name__ == "__main__":
    main()
