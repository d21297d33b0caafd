"""What fits where: the README's layout table, computed by sfchat's own memory estimator.

For one Kaggle notebook with two T4s (local mode, ``--device cuda:0,cuda:1``: head and tail
halves both spread over the two GPUs, the draft where ``memory.place_draft`` puts it) and for two
such notebooks (relay mode, each node spreading its half over its two T4s), per model, prints the
memory each GPU needs at a 4096-token context and the longest context (a multiple of 256) that
fits every GPU. Default settings throughout: split at half the layers, the 0.5B draft in fp16
(compiled and graphed; one row with ``--draft-load-in-4bit``), the default frame of a GPU (63
drafts per frame, ``--max-in-flight 8``: ``node.loading.frame_layout``, whose frame is verified at
one shape, a CUDA graph per attention window, and whose live nodes take scratch slots). A T4
is taken to have ``T4_FREE`` free (15 GB cards with the CUDA context up). Every figure is an
estimate for T4s: nothing here ran on a T4. The last column says which rows' node estimates were
checked against peaks measured on another GPU (``CHECKED``, from bench/RESULTS.md).

Run from the repository root:  python3 bench/layouts.py   (CPU only, about 20 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2Config  # noqa: E402

from sfchat.config import Settings  # noqa: E402
from sfchat.model import memory  # noqa: E402
from sfchat.model.footprint import GIB  # noqa: E402
from sfchat.model.memory import DraftPlan, head_plan, per_device, place_draft, tail_plan  # noqa: E402
from sfchat.node.loading import frame_layout  # noqa: E402

T4_FREE = int(14.5 * GIB)
K = 8
LAYOUT = frame_layout(Settings(), K, cuda=True)
VERIFIES = [(LAYOUT.shape, True)]  # Hello.shapes() of the defaults (a GPU: one row count, canonical attention)
CONTEXT = 4096
MAX_CONTEXT = 32768  # Qwen2.5's max_position_embeddings
GPUS = [torch.device("cuda:0"), torch.device("cuda:1")]
SHAPES = {  # the public configs of Qwen2.5 (hidden, intermediate, layers, heads, kv heads)
    "7B": (3584, 18944, 28, 28, 4),
    "14B": (5120, 13824, 48, 40, 8),
    "32B": (5120, 27648, 64, 40, 8),
    "72B": (8192, 29568, 80, 64, 8),
}
CHECKED = {  # (shape, quantisation): where the estimate of one node's half was checked against a measured peak
    ("7B", "none"): "H100: each node at 32768 tokens, fp16 and bf16 (bigmodel_bench)",
    ("32B", "nf4"): "H100: each node at 19456 tokens, fp16 and bf16 (bigmodel_bench)",
    ("72B", "nf4"): "H100: each node at 4096 tokens, fp16 and bf16, a dense draft (bigmodel_bench)",
    ("32B", "int8"): "H100: each node at 4096 tokens, fp16 (bigmodel_bench)",
}
MODELS = [  # (name, shape, the target's quantisation, the draft's)
    ("Qwen2.5-7B", "7B", "none", "none"), ("Qwen2.5-14B", "14B", "none", "none"),
    ("Qwen2.5-14B", "14B", "nf4", "none"), ("Qwen2.5-32B", "32B", "nf4", "none"),
    ("Qwen2.5-32B", "32B", "int8", "none"),
    ("Qwen2.5-72B", "72B", "nf4", "none"), ("Qwen2.5-72B", "72B", "nf4", "nf4"),
]


def config(size: str) -> Qwen2Config:
    hidden, inter, layers, heads, kv_heads = SHAPES[size]
    return Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=152064,
                       tie_word_embeddings=False, max_position_embeddings=MAX_CONTEXT)


def draft_config() -> Qwen2Config:
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def plans(size: str, quant: str, context: int, draft_quant: str = "none") -> dict[str, list]:
    """The estimator's plans of both layouts at ``context``: {"local": ..., "head": ..., "tail": ...}."""
    cfg, dcfg = config(size), draft_config()
    max_len = context + LAYOUT.scratch
    draft = DraftPlan(dcfg, GPUS[1], torch.float16, draft_quant, rows=LAYOUT.width + 1, children=LAYOUT.children,
                      pool=LAYOUT.draft_pool)
    split = cfg.num_hidden_layers // 2
    target = dict(devices=GPUS, dtype=torch.float16, quant=quant, max_len=max_len, verifies=VERIFIES,
                  one_shape=bool(LAYOUT.rows))
    out = {}
    for name, local in (("local", True), ("head", False)):
        placed = place_draft(cfg, split, draft, local=local, **target)
        out[name] = head_plan(cfg, split, draft=placed, local=local, head_span=LAYOUT.head_pool, **target)
    out["tail"] = tail_plan(cfg, split, **target)
    return out


def gib_per_gpu(plan) -> list[float]:
    totals = per_device(plan)
    return [totals[g][0] / GIB if g in totals else 0.0 for g in GPUS]


def fits(plan) -> bool:
    return all(total <= T4_FREE for total, _ in per_device(plan).values())


def longest(size: str, quant: str, draft_quant: str, layout: str) -> int:
    """The longest context (a multiple of 256) at which every GPU of the layout fits; 0 if none."""
    def ok(context):
        p = plans(size, quant, context, draft_quant)
        return all(fits(p[name]) for name in (("local",) if layout == "local" else ("head", "tail")))

    lo, hi = 0, MAX_CONTEXT // 256
    while lo < hi:  # the need grows with the context
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid * 256) else (lo, mid - 1)
    return lo * 256


def row(name: str, size: str, quant: str, draft_quant: str) -> dict:
    """One model's line of the table (``memory.free_bytes`` faked to ``T4_FREE`` by the caller)."""
    p = plans(size, quant, CONTEXT, draft_quant)
    weights = {"none": "fp16", "nf4": "NF4", "int8": "int8"}[quant] + (", NF4 draft" if draft_quant == "nf4" else "")
    return {"model": name, "weights": weights, "checked": CHECKED.get((size, quant), "no: estimated only"),
            "local": gib_per_gpu(p["local"]), "local_context": longest(size, quant, draft_quant, "local"),
            "head": gib_per_gpu(p["head"]), "tail": gib_per_gpu(p["tail"]),
            "split_context": longest(size, quant, draft_quant, "split")}


def table(data: list[dict]) -> str:
    def gpus(values):
        return " / ".join(f"{v:.1f}" for v in values)

    def context(n):
        return "does not fit" if not n else f"{n} (the model's limit)" if n == MAX_CONTEXT else f"{n}"

    lines = ["| model | weights | one notebook (local): GiB per T4 | longest context | two notebooks: head's "
             "T4s, tail's T4s (GiB) | longest context | estimate checked against a measured peak |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in data:
        lines.append(f"| {r['model']} | {r['weights']} | {gpus(r['local'])} | {context(r['local_context'])} | "
                     f"{gpus(r['head'])}, {gpus(r['tail'])} | {context(r['split_context'])} | {r['checked']} |")
    return "\n".join(lines)


def main() -> None:
    memory.free_bytes = lambda device: T4_FREE  # every T4 as it is when the notebook starts
    print(f"estimated, {T4_FREE / GIB:.1f} GiB free per T4, at a {CONTEXT}-token context; "
          "longest context: every GPU fits\n")
    print(table([row(*m) for m in MODELS]))


if __name__ == "__main__":
    main()
