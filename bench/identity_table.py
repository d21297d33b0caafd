"""One answer whatever the network: the identity table from ``live_bench.py --save`` runs.

Each saved run holds, per (mode, RTT), the token ids of every reply (greedy, or sampled with one
seed: ``live_bench.py --temperature``) and the tok/s. For each run this prints, per (mode, RTT),
how many replies equal the reference's (the run's own ``none`` at its first RTT, else the last
earlier run's: the target alone, one token per round trip) and the tok/s with what it is made of:
the ms a verdict's round takes and the tokens it commits (tok/s across different texts compares
their acceptance as much as their cost; the round's ms compares the cost); then, for runs given
as pairs of the same variant, how many replies each (mode, RTT) repeats from the earlier run.
Runs may differ in what they vary (``--frame-rows``, the code): name each by its file's stem.
A run measured in pieces (a GPU call lasts minutes: one live_bench process per piece, each saving
its own file) is given as ``NAME=FILE,FILE...``: its pieces' cells together, a later piece's cell
replacing an earlier one's. A file that is not a live_bench save is refused with its reason.

    python3 bench/identity_table.py off.json on.json [on-again.json]
    python3 bench/identity_table.py run1=a.json,b.json,c.json run2=d.json,e.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


FIELDS = ("mode", "rtt", "ids", "tps", "round_ms", "tokens_per_verdict")  # what a cell is read from


class TableError(ValueError):
    pass


def load(path: Path) -> dict[tuple[str, int], dict]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TableError(f"{path}: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and set(FIELDS) <= e.keys() for e in entries):
        raise TableError(f"{path}: not a live_bench --save file (a list of entries with {', '.join(FIELDS)})")
    return {(e["mode"], e["rtt"]): e for e in entries}


def runs_of(args: list[str]) -> dict[str, dict[tuple[str, int], dict]]:
    """Each argument a run: ``FILE`` (named by its stem) or ``NAME=FILE,FILE...`` (its pieces merged)."""
    runs: dict[str, dict[tuple[str, int], dict]] = {}
    for arg in args:
        name, sep, files = arg.partition("=")
        if not sep:
            name, files = Path(arg).stem, arg
        if not name or not files or name in runs:
            raise TableError(f"{arg!r}: give each run as FILE or NAME=FILE[,FILE...], each name once")
        runs[name] = {}
        for f in files.split(","):
            runs[name].update(load(Path(f)))
    return runs


def same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def main(args: list[str]) -> int:
    try:
        runs = runs_of(args)
    except TableError as exc:
        print(f"identity_table: {exc}", file=sys.stderr)
        return 2
    if not runs:
        print("identity_table: name at least one saved run", file=sys.stderr)
        return 2
    refs, ref = {}, None  # each run's reference: its own none at its first RTT, else the last earlier run's
    for name, run in runs.items():
        ref = next((v for (m, _), v in run.items() if m == "none"), ref)
        refs[name] = ref
    keys = list(dict.fromkeys(k for run in runs.values() for k in run))
    print("| mode | RTT ms | " + " | ".join(f"{name}: same as its none / tok/s / round ms / tokens a verdict"
                                         for name in runs) + " |")
    print("| --- | --- |" + " --- |" * len(runs))
    for key in keys:
        cells = []
        for name, run in runs.items():
            ref = refs[name]
            if key not in run:
                cells.append("-")
                continue
            r = run[key]
            told = f"{same(r['ids'], ref['ids'])}/{len(r['ids'])}" if ref else "?"
            cells.append(f"{told} / {r['tps']:.1f} / {r['round_ms']:.1f} / {r['tokens_per_verdict']:.2f}")
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    for name, run in runs.items():
        replies = [v["ids"] for v in run.values()]
        all_same = sum(all(rep[i] == replies[0][i] for rep in replies) for i in range(len(replies[0])))
        print(f"{name}: replies identical across every mode and RTT: {all_same} of {len(replies[0])}")
    names = list(runs)
    for a, b in zip(names, names[1:]):
        common = [k for k in runs[a] if k in runs[b]]
        if common:
            got = sum(same(runs[a][k]["ids"], runs[b][k]["ids"]) for k in common)
            total = sum(len(runs[a][k]["ids"]) for k in common)
            print(f"{a} against {b}: {got} of {total} replies the same, mode by mode")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
