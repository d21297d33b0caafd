"""live_bench's report: the modes run at each RTT, the saved run and the printed table."""

from __future__ import annotations

import json
from pathlib import Path


def modes_at(modes: list[str], rtt: int, rtts: list[int], reference_once: bool) -> list[str]:
    """The modes run at ``rtt``: all of them, or with ``reference_once`` no ``none`` after the first RTT."""
    return [m for m in modes if not (reference_once and m == "none" and rtt != rtts[0])]


def save(path: Path, res: dict) -> None:
    """Every mode's results so far as JSON rows (mode, rtt, figures, token ids), replacing ``path``
    whole (written beside it, then renamed: a run killed mid-write leaves the last complete file)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps([{"mode": m, "rtt": r, **v} for (m, r), v in res.items()]))
    part.replace(path)


VERDICT_FIELDS = ("schedule", "committed", "expected", "in_flight", "rtt_ms", "tail_ms", "round_ms", "draft_ms",
                  "head_ms", "forward_bytes", "draft_steps", "ahead_steps", "wait_ms")


def verdict_rows(stats) -> dict:
    """Every verdict's figures in order (``RoundStats``, the fields ``VERDICT_FIELDS``): what
    ``--verdicts`` saves, for a look at one phase of a run (auto's streamed verdicts after a trial)."""
    return {"fields": list(VERDICT_FIELDS), "rows": [[getattr(s, f) for f in VERDICT_FIELDS] for s in stats]}


def row(r: dict, base: float | None, rtt: int) -> str:
    """One mode's figures as the table's cells from tok/s on."""
    ratio = f"{r['tps'] / base:.2f}x" if base else ""
    per_trip = f"{r['tps'] * rtt / 1000:.2f}" if rtt else ""
    return (f"{r['tps']:.1f} | {ratio} | {per_trip} | {r['tokens_per_verdict']:.2f} ({r['expected']:.2f}) | "
            f"{r['in_flight']:.2f} | "
            f"{r['draft_ms']:.1f} | {r['head_ms']:.1f} | {r['tail_ms']:.1f} | {r['rtt_ms']:.1f} | "
            f"{r['wait_ms']:.1f} | {r['overlap_ms']:.1f} | {r['rest_ms']:.1f} | "
            f"{r['draft_steps']:.1f}, {r['ahead_steps']:.1f} | "
            f"{r['frame_draft_ms'] + r['frame_head_ms']:.1f} ({r['frame_draft_ms']:.1f} + {r['frame_head_ms']:.1f}), "
            f"{r['frame_steps']:.1f} | "
            + ", ".join(f"{k} {v:.0%}" for k, v in r.get("schedules", {}).items()) + " |")


def print_table(res, rtts, modes, ranks, reference_once=False) -> None:
    print("\n| RTT ms | mode | tok/s | vs chain | tokens a round trip | tokens/verdict (predicted) | in flight | draft | "
          "head | tail | net | "
          "wait | overlap | rest (ms per verdict) | draft steps: frames, ahead | a steady frame's build ms (draft + "
          "head), its draft steps | verdicts per schedule |")
    print("|" + " --- |" * 17)
    for rtt in rtts:
        base = res[("chain", rtt)]["tps"] if ("chain", rtt) in res else None
        for mode in modes_at(modes, rtt, rtts, reference_once):
            print(f"| {rtt} | {mode} | " + row(res[(mode, rtt)], base, rtt))
    replies = [r["ids"] for r in res.values()]
    same = sum(all(rep[i] == replies[0][i] for rep in replies) for i in range(len(replies[0])))
    print(f"\nidentical replies across every mode and RTT: {same} of {len(replies[0])}")
    total = sum(ranks)
    print("rank of the target's pick among the draft's proposals (last: not proposed): "
          + ", ".join(f"{c / total:.3f}" for c in ranks) if total else "no ranks recorded")
