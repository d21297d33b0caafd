"""How much of a schedule's rate over a stretch of verdicts is the text it fell on: a saved synthetic run.

Why: the policy compares schedules on trials of ~1 s each, and each trial falls on its own stretch of
the reply. On the synthetic pair (``live_bench.py --ranks``) the draft proposes the target's next
token at a rank fixed per token (``live_bench.draw_ranks``), so how easy a stretch is for the draft
is known exactly: this script reads a ``live_bench.py --verdicts --save`` file, gives every verdict
the draft ranks of the tokens it committed (the reply's token ids are saved), cuts each reply of
each mode into stretches of ``--stretch`` verdicts (the first ``--skip`` of a reply, its prefill
and the pipeline's fill, left out), and prints per stretch its committed tokens per ms and the
share of its tokens the draft proposed first (rank 0), then per mode the spread of the rates, their
correlation with that share, and what a correction for the text would leave: the spread of
log(rate), and the root mean square of its error where each stretch's log(rate) is predicted from
the log of its share proposed first or second, fitted on the other stretches (a correlation that one
stretch carries shows as no gain there). A spread the correction removes says that a trial's
rate measures the text as much as the schedule (issue 48, part 2). Reads a file; runs nothing.

    python3 bench/stretch_difficulty.py RUN.json [--stretch 50] [--skip 3] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import QWEN25_05B  # noqa: E402
from live_bench import draw_ranks, prompts_for  # noqa: E402

PERM_SEED = 1234  # live_bench's permutation: the synthetic target's next token after each token


def verdict_ranks(ids: list[list[int]], prompts: list[list[int]], committed: list[int], rank: list[int]
                  ) -> list[tuple[int, list[int]]]:
    """(reply, the draft ranks of the tokens it committed) per verdict, the verdicts in order over
    the replies: each committed token's rank is its predecessor's (the draft's proposals after a
    token put the target's next one at that token's rank)."""
    out, reply, at = [], 0, 0
    for n in committed:
        seq = [prompts[reply][-1]] + ids[reply]
        out.append((reply, [rank[seq[at + j]] for j in range(n)]))
        at += n
        if at >= len(ids[reply]) and reply + 1 < len(ids):
            reply, at = reply + 1, 0
    return out


def stretches(rows: list[dict], ranks: list[tuple[int, list[int]]], size: int, skip: int
              ) -> list[tuple[int, float, float, float]]:
    """(reply, rank-0 share, committed tokens per ms, share at rank 0 or 1) of each whole stretch
    of ``size`` verdicts (a reply's last, shorter than half of ``size``, left out), after a
    reply's first ``skip``."""
    out = []
    for reply in sorted({r for r, _ in ranks}):
        mine = [(row, rk) for row, (r, rk) in zip(rows, ranks) if r == reply][skip:]
        for a in range(0, len(mine), size):
            part = mine[a:a + size]
            ms = sum(row["round_ms"] for row, _ in part)
            tokens = [k for _, rk in part for k in rk]
            if len(part) < size / 2 or ms <= 0 or not tokens:
                continue
            out.append((reply, sum(k == 0 for k in tokens) / len(tokens), sum(len(rk) for _, rk in part) / ms,
                        sum(k < 2 for k in tokens) / len(tokens)))
    return out


def correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sx, sy = statistics.pstdev(xs), statistics.pstdev(ys)
    if sx == 0 or sy == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / len(xs) / (sx * sy)


def left_out_error(xs: list[float], ys: list[float]) -> float:
    """The root mean square error of each y predicted by a line through the other points."""
    errors = []
    for i in range(len(xs)):
        ox, oy = xs[:i] + xs[i + 1:], ys[:i] + ys[i + 1:]
        mx, my = statistics.fmean(ox), statistics.fmean(oy)
        spread = sum((x - mx) ** 2 for x in ox)
        slope = sum((x - mx) * (y - my) for x, y in zip(ox, oy)) / spread if spread else 0.0
        errors.append(ys[i] - (my + slope * (xs[i] - mx)))
    return math.sqrt(statistics.fmean(e * e for e in errors))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a live_bench.py --ranks ... --verdicts --save file")
    ap.add_argument("--stretch", type=int, default=50, help="verdicts a stretch (about a trial's)")
    ap.add_argument("--skip", type=int, default=3, help="each reply's first verdicts left out")
    ap.add_argument("--vocab", type=int, default=QWEN25_05B["vocab_size"], help="the synthetic pair's vocabulary")
    ap.add_argument("--ranks", type=Path, default=Path(__file__).parent / "results" / "pair_ranks.json",
                    help="the rank histogram the run drew from (live_bench --ranks)")
    args = ap.parse_args(argv)
    try:
        runs = json.loads(args.run.read_text())
        modes = [r for r in runs if r.get("per_verdict") and r.get("ids")]
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        print(f"stretch_difficulty: {args.run}: not a live_bench --save file ({exc})", file=sys.stderr)
        return 2
    if not modes:
        print(f"stretch_difficulty: {args.run} has no mode saved with --verdicts", file=sys.stderr)
        return 2
    perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(PERM_SEED)).tolist()
    rank = draw_ranks(json.loads(args.ranks.read_text()), args.vocab)
    print("| RTT | mode | reply | rank-0 share | tokens/ms |\n| --- | --- | --- | --- | --- |")
    summary = []
    for run in modes:
        fields = run["per_verdict"]["fields"]
        rows = [dict(zip(fields, r)) for r in run["per_verdict"]["rows"]]
        ids = run["ids"]
        prompts = prompts_for(None, True, len(ids))
        if any(perm[a] != b for p, g in zip(prompts, ids) for a, b in zip([p[-1]] + g[:-1], g)):
            print(f"stretch_difficulty: {run['mode']} at {run['rtt']} ms: its replies are not the synthetic "
                  "target's (another --vocab, or not a --ranks run)", file=sys.stderr)
            return 2
        parts = stretches(rows, verdict_ranks(ids, prompts, [r["committed"] for r in rows], rank),
                          args.stretch, args.skip)
        for reply, share, rate, _ in parts:
            print(f"| {run['rtt']} | {run['mode']} | {reply + 1} | {share:.2f} | {rate:.4f} |")
        if len(parts) >= 3:
            shares, rates = [p[1] for p in parts], [p[2] for p in parts]
            logs, two = [math.log(r) for r in rates], [math.log(max(p[3], 1e-3)) for p in parts]
            summary.append(f"| {run['rtt']} | {run['mode']} | {len(parts)} | {min(rates):.4f}-{max(rates):.4f} | "
                           f"{statistics.pstdev(rates) / statistics.fmean(rates):.3f} | "
                           f"{correlation(shares, rates):.2f} | {statistics.pstdev(logs):.3f} | "
                           f"{left_out_error(two, logs):.3f} |")
    print("\n| RTT | mode | stretches | tokens/ms | CV | correlation with the rank-0 share | log(rate) spread | "
          "its error corrected by the rank-0/1 share, each stretch left out |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
