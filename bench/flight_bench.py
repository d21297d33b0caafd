"""Speculation in flight with adaptive budgets against sequential rounds, through a real relay.

One head engine per draft talks to a tail process through a real sfchat-relay on loopback at each
emulated RTT (sealed end to end, as relay mode is by default). Each engine is built with every
shape of ``--k auto --tree-budget 64`` captured (chains of 0, 2, 4 and 8 drafts, a 64-node tree
8 deep), and three modes run on it one after the other, each learning from scratch:

  * ``chain``: a chain of 8 drafts, one round per round trip (sfchat's round before frames in flight);
  * ``tree``: a 64-node tree, one round per round trip;
  * ``flight``: the adaptive policy choosing shape and frames in flight (up to ``--max-in-flight``).

tok/s is tokens committed over wall time across ``--rounds`` verdicts, after ``--warm`` verdicts
(the policy's first rounds try each shape once); with ``--span A,B``, across the verdicts that
commit tokens A..B of the reply, the same stretch of the same greedy text in every mode (a real
pair's acceptance varies along the text). Drafts:

  * GPU (default): bf16 checkpoints with the shapes of Qwen2.5-7B (target) and 0.5B (draft), one
    GPU. The target's weights are random but its greedy next token is a fixed permutation of the
    current one (``gpu_bench.write_checkpoint(follows=)``: random weights alone leave near-ties
    that bf16 rounding flips between a draft and a verify of other shapes). ``agree`` is a 0.5B
    built the same way (full acceptance at a 0.5B draft's cost); ``target`` is the target drafting
    for itself (full acceptance at a 7B draft's cost, graphed, not compiled); ``random`` is a random
    0.5B (no acceptance). With ``--pair-stats`` (a JSON written by the
    ``--pair`` mode), tok/s is also derived for a real pair's acceptance: the policy's own rate
    model, fed the figures the ``random`` engine measured in the flight mode (compute and tail per
    shape, link base and cost per byte) and the pair's acceptance per depth, bonus guess rate and
    tree tokens per round. A derived figure, not a run.
  * ``--pair TARGET DRAFT``: a real pair (for example SmolLM2-135M and its round4 copy, see
    bench/tree_accept.py) on ``--device`` (the CPU by default); the chain mode's accepted-draft
    histogram gives acceptance per depth and the flight mode the guess rate: ``--stats-out`` keeps them.

Run from the repository root:
    python3 bench/flight_bench.py [--rtts 0,30,86,200] [--rounds 40] [--pair-stats stats.json]
    python3 bench/flight_bench.py --pair DIR DIR --rtts 86 --stats-out stats.json
Needs torch, transformers, safetensors, websockets, cryptography and platformdirs (and a CUDA GPU
without --pair).
"""

from __future__ import annotations

import argparse
import collections
import json
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
from sfchat.engine.policy import Shape, SpeculationPolicy, menu  # noqa: E402

K, BUDGET = 8, 64
PROMPT = list(range(200, 328))
CHAIN, TREE = Shape(K), Shape(K, BUDGET)


def modes(max_in_flight: int, tree: bool) -> dict:
    out = {"chain": ([CHAIN], 1)}
    if tree:
        out["tree"] = ([TREE], 1)
    out["flight"] = (menu(K, BUDGET if tree else 0, auto_depth=True), max_in_flight)
    return out


def measure(engine, shapes, m: int, warm: int, n: int, prompt: list[int], span: tuple[int, int] | None = None) -> dict:
    """``n`` verdicts after ``warm``; or, with ``span`` (a, b), the verdicts that commit the reply's
    tokens a..b (every mode then times the same stretch of the same greedy text)."""
    engine.rounds.shapes, engine.max_in_flight = shapes, m
    engine.policy = SpeculationPolicy(shapes, m)  # each mode learns from scratch
    engine.begin(prompt)
    done = 0
    while (done < span[0]) if span else (warm > 0):
        done += engine.round(GREEDY, set(), 10 ** 6).stats.committed
        warm -= 1
    t0 = time.perf_counter()
    stats = []
    while (done < span[1]) if span else (len(stats) < n):
        stats.append(engine.round(GREEDY, set(), 10 ** 6).stats)
        done += stats[-1].committed
    wall = time.perf_counter() - t0
    n = len(stats)
    tokens = sum(s.committed for s in stats)
    shapes_used = collections.Counter(f"tree {s.tree_nodes}" if s.tree_nodes else f"chain {s.depth}" for s in stats)
    return {"tps": tokens / wall, "tokens_per_round": tokens / n, "rounds_per_s": n / wall,
            "in_flight": sum(s.in_flight for s in stats) / n, "hits": sum(s.speculated for s in stats) / n,
            "rtt_ms": sum(s.rtt_ms for s in stats) / n, "shapes": dict(shapes_used.most_common()),
            "histogram": collections.Counter(s.accepted for s in stats), "policy": engine.policy}


def policy_state(p: SpeculationPolicy) -> dict:
    return {"compute": {str(s): v for s, v in p.compute.items()}, "tail": {str(s): v for s, v in p.tail.items()},
            "bytes": {str(s): v for s, v in p.bytes.items()}, "base_ms": p.base_ms, "ms_per_byte": p.ms_per_byte,
            "accept": p.accept, "guess": p.guess, "overhead": p.overhead}


def derive(measured: SpeculationPolicy, pair: dict, max_in_flight: int) -> dict:
    """tok/s of chain, tree and the adaptive choice for ``pair``'s acceptance, from the rate model."""
    shapes = menu(K, BUDGET, auto_depth=True)
    p = SpeculationPolicy(shapes, max_in_flight)
    p.compute, p.tail, p.bytes = dict(measured.compute), dict(measured.tail), dict(measured.bytes)
    p.base_ms, p.ms_per_byte, p.overhead = measured.base_ms, measured.ms_per_byte, measured.overhead
    reach = pair["reach"]  # P(at least d of K drafts accepted), d = 0..K
    p.accept = [None] + [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, K + 1)]
    p.guess = pair["guess"]
    p.tokens[TREE], p.full[TREE] = pair["tree_tokens"], pair.get("tree_full", reach[K])
    best = max(((s, m) for s in shapes for m in range(1, max_in_flight + 1)), key=lambda sm: p.rate(*sm))
    return {"chain": 1e3 * p.rate(CHAIN, 1), "tree": 1e3 * p.rate(TREE, 1), "flight": 1e3 * p.rate(*best),
            "choice": f"{best[0]} x{best[1]}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtts", default="0,30,86,200")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--max-in-flight", type=int, default=8)
    ap.add_argument("--span", help="A,B: time the verdicts that commit tokens A..B of the reply, not --rounds")
    ap.add_argument("--pair", nargs=2, type=Path, metavar=("TARGET", "DRAFT"), help="a real pair's model directories")
    ap.add_argument("--device", default=None, help="with --pair: cpu (default) or cuda")
    ap.add_argument("--pair-stats", type=Path, help="a real pair's acceptance (from --pair --stats-out): derive tok/s")
    ap.add_argument("--stats-out", type=Path)
    ap.add_argument("--tree-tokens", type=float, help="with --stats-out and no tree mode (the CPU): the pair's "
                    f"tokens per round with a {BUDGET}-node tree {K} deep, as bench/tree_accept.py measured it")
    ap.add_argument("--drafts", default="agree,target,random")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    ap.add_argument("--save", type=Path, help="write every figure as JSON (after each RTT)")
    ap.add_argument("--derive", type=Path, help="print the derived table from a --save file and --pair-stats")
    args = ap.parse_args()
    rtts = [int(x) for x in args.rtts.split(",")]
    span = tuple(int(x) for x in args.span.split(",")) if args.span else None
    if args.derive:
        rows = json.loads(args.derive.read_text())
        pair = json.loads(args.pair_stats.read_text())
        print_derived({r["rtt"]: restore(r["policy"]) for r in rows if r["draft"] == "random" and r["mode"] == "flight"},
                      pair, args.max_in_flight)
        return
    if args.pair:
        gpu_bench.DEVICE = args.device or "cpu"
        target, drafts = args.pair[0].resolve(), {"pair": args.pair[1].resolve()}
        models_dir, prompt = target.parent, None
    else:
        if args.smoke:
            gpu_bench.DEVICE = "cpu"
        shapes = (TINY_TARGET, TINY_DRAFT) if args.smoke else (QWEN25_7B, QWEN25_05B)
        root = Path(tempfile.mkdtemp(prefix="sfchat-flight-bench-"))
        vocab = shapes[1]["vocab_size"]  # the target's next token follows a permutation of the draft vocabulary
        write_checkpoint(root / "target", shapes[0], seed=0, follows=vocab)
        write_checkpoint(root / "draft", shapes[1], seed=1)
        if "agree" in args.drafts:
            write_checkpoint(root / "agree", dict(shapes[1], tie_word_embeddings=False), seed=2, follows=vocab)
        target, models_dir, prompt = root / "target", root, PROMPT
        names = {"target": root / "target", "random": root / "draft", "agree": root / "agree"}
        drafts = {d: names[d] for d in args.drafts.split(",")}
        print(f"checkpoints written to {root}", file=sys.stderr, flush=True)
    tree = gpu_bench.DEVICE != "cpu" or args.smoke
    mode_list = modes(args.max_in_flight, tree)
    res: dict = {}
    engines: dict = {}
    for rtt in rtts:  # one relay and tail per RTT; every draft's head talks to it in turn
        with relay_and_tail(rtt, models_dir, session=f"flight-{rtt}") as url:
            for draft_name, draft in drafts.items():
                s = Settings(model=str(target), draft=str(draft), k="auto", tree_budget=BUDGET if tree else 0,
                             device=gpu_bench.DEVICE, max_context=2048, compile_draft=False,
                             max_in_flight=args.max_in_flight)
                engines[draft_name] = engine = engine_facing(s, url, f"flight-{rtt}", engines.get(draft_name))
                ids = prompt or pair_prompt(target)
                for mode, (shapes, m) in mode_list.items():
                    out = measure(engine, shapes, m, args.warm, args.rounds, ids, span)
                    res[(draft_name, rtt, mode)] = out
                    print(f"{draft_name} rtt {rtt} {mode}: {out['tps']:.1f} tok/s {out['shapes']}",
                          file=sys.stderr, flush=True)
                engine.link.close()
        if args.save:
            save(res, args.save)
    pair = json.loads(args.pair_stats.read_text()) if args.pair_stats else None
    print_table(res, rtts, drafts, mode_list, pair, args.max_in_flight)
    if args.stats_out and args.pair:
        write_stats(res, rtts, args.stats_out, args.tree_tokens)


def save(res: dict, path: Path) -> None:
    """Every figure (the policies as their measured state), for ``--derive``."""
    rows = [{"draft": d, "rtt": r, "mode": m, **{k: v for k, v in out.items() if k != "policy"},
             "histogram": dict(out["histogram"]), "policy": policy_state(out["policy"])}
            for (d, r, m), out in res.items()]
    path.write_text(json.dumps(rows, indent=1))


def restore(state: dict) -> SpeculationPolicy:
    shapes = {str(s): s for s in menu(K, BUDGET, auto_depth=True)}
    p = SpeculationPolicy(list(shapes.values()), 1)
    p.compute = {shapes[k]: v for k, v in state["compute"].items()}
    p.tail = {shapes[k]: v for k, v in state["tail"].items()}
    p.bytes = {shapes[k]: v for k, v in state["bytes"].items()}
    p.base_ms, p.ms_per_byte, p.overhead = state["base_ms"], state["ms_per_byte"], state.get("overhead", 0.0)
    return p


def pair_prompt(target: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    text = tok.apply_chat_template([{"role": "user", "content": "Explain how a relay server pairs two machines, "
                                     "and why both of them dial out to it."}], add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def write_stats(res: dict, rtts: list[int], path: Path, tree_tokens: float | None) -> None:
    hist = collections.Counter()
    for (_, _, mode), out in res.items():
        if mode == "chain":
            hist.update(out["histogram"])
    total = sum(hist.values())
    reach = [sum(c for a, c in hist.items() if a >= d) / total for d in range(K + 1)]
    flight = res[("pair", rtts[-1], "flight")]
    trees = [out["tokens_per_round"] for (_, _, mode), out in res.items() if mode == "tree"]
    stats = {"reach": reach, "guess": flight["policy"].guess,
             "tokens_per_round_chain": sum(a * c for a, c in hist.items()) / total + 1,
             "tree_tokens": sum(trees) / len(trees) if trees else tree_tokens, "rounds": total}
    path.write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats), file=sys.stderr)


def print_table(res: dict, rtts, drafts, mode_list, pair, max_in_flight) -> None:
    print("\n| draft | RTT ms | mode | tok/s | vs chain | tokens/round | in flight | hits | shapes used |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for d in drafts:
        for rtt in rtts:
            base = res[(d, rtt, "chain")]["tps"]
            for mode in mode_list:
                out = res[(d, rtt, mode)]
                used = ", ".join(f"{k} {v}" for k, v in list(out["shapes"].items())[:3])
                print(f"| {d} | {rtt} | {mode} | {out['tps']:.1f} | {out['tps'] / base:.2f}x | "
                      f"{out['tokens_per_round']:.2f} | {out['in_flight']:.2f} | {out['hits']:.0%} | {used} |")
    full = [d for d in ("agree", "target") if d in drafts]
    if full:
        print("\n| RTT ms | sequential (K+1)/RTT ceiling | " + " | ".join(f"flight, {d} | ratio" for d in full) + " |")
        print("| --- | --- |" + " --- | --- |" * len(full))
        for rtt in rtts:
            if rtt:
                ceiling = (K + 1) * 1e3 / rtt
                got = [res[(d, rtt, "flight")]["tps"] for d in full]
                print(f"| {rtt} | {ceiling:.1f} | " + " | ".join(f"{g:.1f} | {g / ceiling:.2f}x" for g in got) + " |")
    if "random" in drafts:
        print("\n| RTT ms | policy's figures (random draft, flight mode) |")
        print("| --- | --- |")
        for rtt in rtts:
            st = policy_state(res[("random", rtt, "flight")]["policy"])
            comp = ", ".join(f"{k} {v:.1f}" for k, v in st["compute"].items())
            print(f"| {rtt} | base {st['base_ms']:.1f} ms, {st['ms_per_byte'] * 1e6:.1f} ms/MB; compute {comp} |")
    if pair is not None and "random" in drafts:
        print_derived({rtt: res[("random", rtt, "flight")]["policy"] for rtt in rtts}, pair, max_in_flight)


def print_derived(policies: dict, pair: dict, max_in_flight: int) -> None:
    print("\n| RTT ms | derived for the real pair: chain | tree | flight (choice) | flight vs chain |")
    print("| --- | --- | --- | --- | --- |")
    for rtt, policy in policies.items():
        der = derive(policy, pair, max_in_flight)
        print(f"| {rtt} | {der['chain']:.1f} | {der['tree']:.1f} | {der['flight']:.1f} ({der['choice']}) | "
              f"{der['flight'] / der['chain']:.2f}x |")


if __name__ == "__main__":
    main()
