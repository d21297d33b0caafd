"""The identity table (issue 46): whether every mode, RTT and run gave the same replies, from the
JSON files `bench/live_bench.py --save` writes, and what each mode's tok/s was against a
"before" configuration.

A GPU call is limited to minutes, so a table of every mode at several RTTs, twice, is measured in
pieces: each piece a live_bench process saving its own file. This script puts them together.

    python3 bench/identity_table.py RUN=FILE[,FILE...] [RUN=FILE...] [--before RUN=FILE...]
        [--reference MODE]

Every reply (the token ids of a prompt) is compared with the reference: the first run's replies in
``--reference`` mode (default ``none``, the target's own output) at the lowest RTT it has. A cell
says how many of its replies equal the reference's; the replies of a cell must be of the same
prompts, in the same order, as the reference's (checked: the files of one table come from one
script with one ``--prompts``). With ``--before``, each (mode, RTT) also gets its tok/s against
the mean of the before runs' (the cost of the change). Prints markdown; exits 1 when a reply
differs (so a script can tell), 2 on unusable input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


ORDER = ("none", "chain", "tree", "tree-ahead", "stream", "auto")  # live_bench's modes; others after them


class TableError(ValueError):
    pass


def load_runs(specs: list[str]) -> dict[str, dict[tuple[str, int], dict]]:
    """``RUN=FILE[,FILE...]`` -> run -> (mode, rtt) -> the saved entry (a later file's wins)."""
    runs: dict[str, dict[tuple[str, int], dict]] = {}
    for spec in specs:
        name, sep, files = spec.partition("=")
        if not sep or not name or not files:
            raise TableError(f"{spec!r}: expected RUN=FILE[,FILE...]")
        cells = runs.setdefault(name, {})
        for f in files.split(","):
            try:
                entries = json.loads(Path(f).read_text())
            except (OSError, ValueError) as exc:
                raise TableError(f"{f}: {exc}") from None
            if not isinstance(entries, list):
                raise TableError(f"{f}: not a live_bench --save file (a list of entries)")
            for e in entries:
                if not isinstance(e, dict) or not {"mode", "rtt", "tps", "ids"} <= e.keys():
                    raise TableError(f"{f}: an entry without mode, rtt, tps and ids")
                cells[(str(e["mode"]), int(e["rtt"]))] = e
    return runs


def reference(runs: dict, mode: str) -> tuple[tuple[str, int], list]:
    first = next(iter(runs.values()))
    rtts = sorted(r for m, r in first if m == mode)
    if not rtts:
        raise TableError(f"the first run has no {mode!r} replies to compare with (--reference)")
    return (mode, rtts[0]), first[(mode, rtts[0])]["ids"]


def table(runs: dict, before: dict, ref_mode: str) -> tuple[list[str], bool]:
    """The markdown lines and whether every reply equals the reference."""
    (rm, rr), ref = reference(runs, ref_mode)
    keys = sorted({k for cells in runs.values() for k in cells}, key=lambda k: (k[1], ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[0]))
    names = list(runs)
    head = ["RTT", "mode"] + [f"{n}: same as reference" for n in names] + [f"{n}: tok/s" for n in names]
    if before:
        head += ["before: tok/s", "after / before"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    same_all = True
    for mode, rtt in keys:
        row = [str(rtt), mode]
        tps = []
        for n in names:
            e = runs[n].get((mode, rtt))
            if e is None:
                row.append("")
                continue
            if len(e["ids"]) != len(ref):
                raise TableError(f"run {n}, {mode} at {rtt} ms: {len(e['ids'])} replies, the reference {len(ref)}")
            same = sum(a == b for a, b in zip(e["ids"], ref))
            same_all &= same == len(ref)
            row.append(f"{same} of {len(ref)}")
            tps.append(float(e["tps"]))
        row += [f"{runs[n][(mode, rtt)]['tps']:.1f}" if (mode, rtt) in runs[n] else "" for n in names]
        if before:
            old = [float(b[(mode, rtt)]["tps"]) for b in before.values() if (mode, rtt) in b]
            row.append(", ".join(f"{t:.1f}" for t in old))
            row.append(f"{statistics.fmean(tps) / statistics.fmean(old):.2f}x" if old and tps else "")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append(f"reference: run {names[0]}, {rm} at {rr} ms; every reply the same: {'yes' if same_all else 'NO'}")
    return lines, same_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN=FILE[,FILE...]")
    ap.add_argument("--before", nargs="*", default=[], metavar="RUN=FILE[,FILE...]")
    ap.add_argument("--reference", default="none", metavar="MODE")
    args = ap.parse_args(argv)
    try:
        lines, same = table(load_runs(args.runs), load_runs(args.before) if args.before else {}, args.reference)
    except TableError as exc:
        print(f"identity_table: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
