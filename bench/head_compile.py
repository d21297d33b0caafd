"""The target's 64-row canonical frame with its whole slice compiled, against the product's forward.

The head's and the tail's frames run one fixed shape (``ModelSlice(rows=64)``, canonical attention)
replayed from CUDA graphs; the product compiles at most the attention (``--compile-attention``).
This probe compiles each segment's whole forward (``ModelSlice._segment``: norms, rotary, residuals
and attention, the GEMMs left to cuBLAS) as ``--compile-frames`` does (``GraphTable(compile=)``
with the product's options for compiled attention, ``attention.compile_options``: rounding as
written, deterministic), captures it in a graph over one window, and compares, at one context, on random weights in the shapes of Qwen2.5-7B:

  * the head half (layers [0, 14) with the embedding) and, with ``--tail``, the tail half (layers
    [14, 28), the norm and lm_head, logits of every row): ms per graphed frame for the plain
    forward (the product's default), the attention compiled, and the whole forward compiled;
  * whether the whole compiled forward gives the same bits after a second compile in the same
    process (``torch._dynamo.reset()`` between, Inductor's caches off for it), i.e. whether it is one code, and how far its
    outputs are from the plain forward's (max abs difference; other bits are expected: the
    identity across modes holds when every mode runs the same code);
  * the compile time of each;
  * with ``--quant nf4`` / ``int8``, the decoder layers' linears quantised as the product loads them
    (bitsandbytes): whether the whole forward compiles over them or the table falls back to the
    plain code (the last column says which).

Run from the repository root:  python3 bench/head_compile.py [--context 500] [--calls 50] [--tail]
    python3 bench/head_compile.py --quant nf4 [--tail]   (needs bitsandbytes)
    python3 bench/head_compile.py --tiny   (the CPU, tiny shapes: checks the script, measures nothing)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify_breakdown import SHAPES, TINY, random_slice, timed  # noqa: E402

from sfchat.engine.scratch import Scratch  # noqa: E402
from sfchat.model import attention  # noqa: E402
from sfchat.model.graphs import GraphTable  # noqa: E402
from sfchat.model.kv import causal_keys  # noqa: E402
from sfchat.model.quant import quantize_linears  # noqa: E402

ROWS = 64
POOL = 9 * ROWS + 1  # the GPU default's head scratch


def frame_rows(n: int, base: int) -> list[tuple[int, int, list[int]]]:
    """A 4-ary tree of ``n`` nodes hung after a context of ``base`` positions: (position, key, ancestor keys)."""
    rows, parents = [], {0: []}
    for i in range(n):
        parent = (i - 1) // 4 if i else None
        ancestors = [] if parent is None else parents[parent] + [parent]
        parents[i] = ancestors
        rows.append((base + len(ancestors), i, ancestors))
    return rows


def capture(sl, n_logits: int, window: int, cuda: bool) -> None:
    """The one-shape tree forward's graph over ``window`` only (``ModelSlice.capture`` takes every window)."""
    if not cuda:
        return
    dev = sl.device
    x = (torch.zeros(ROWS, dtype=torch.long, device=dev) if sl.embed_tokens is not None
         else torch.zeros(ROWS, sl.config.hidden_size, dtype=sl.dtype, device=dev))
    positions = torch.arange(ROWS, device=dev)
    inputs = (x, positions, positions.clone(), causal_keys(positions))
    key = sl._key(ROWS, n_logits, True)
    sl.graphs.capture(key + (0,), "probe", sl._segment(0, n_logits, True), inputs, [window])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--tail", action="store_true", help="the tail half too (norm and lm_head, 64 logits)")
    ap.add_argument("--quant", choices=("none", "nf4", "int8"), default="none",
                    help="the decoder layers' linears quantised as the product loads them")
    args = ap.parse_args()
    from torch._inductor import config as inductor
    cuda = not args.tiny and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    (name, shape), _ = list((TINY if args.tiny else SHAPES).items())
    halves = {f"{name} (with the embedding)": dict(shape, embed=True)}
    if args.tail:
        half = shape["hi"] - shape["lo"]
        halves[name.replace("head", "tail")] = dict(shape, lo=shape["hi"], hi=shape["hi"] + half, head=True)
    n, ctx = (args.calls if cuda else 2), args.context
    print(f"\n{torch.cuda.get_device_name() if cuda else 'CPU (nothing measured)'}, {dtype}, {ROWS} rows, context {ctx}, "
          f"{n} calls a figure, linears {args.quant}\n")
    print("| slice | variant | ms a frame | compile + capture s | max abs diff to plain | same bits after a second compile "
          "| compiled (else fell back) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, sh in halves.items():
        sl = random_slice(sh, dtype, device, 4096 + POOL, rows=ROWS)
        if args.quant != "none":
            for layer in sl.layers:
                quantize_linears(layer, dtype, args.quant)
            sl.quant = args.quant
        n_logits = ROWS if sl.lm_head is not None else 0
        gen = torch.Generator(device=device).manual_seed(1)
        if sl.embed_tokens is not None:
            ids = torch.randint(0, 300, (ctx - 1,), generator=gen, device=device)
            x = torch.randint(0, 300, (ROWS,), generator=gen, device=device)
        else:
            ids = torch.randn(ctx - 1, sh["hidden_size"], generator=gen, device=device).to(dtype)
            x = torch.randn(ROWS, sh["hidden_size"], generator=gen, device=device).to(dtype)
        sl.feed(ids, 0)
        sl.note(0, list(range(ctx - 1)))
        scratch = Scratch(sl, POOL)
        scratch.reset(ctx - 1)
        slots, mask = scratch.tree_inputs(frame_rows(ROWS, ctx - 1), ROWS, device)
        window = sl.window_for(scratch.reach)

        def frame():
            return sl.run(x, slots, n_logits, end=scratch.reach, tree=mask)

        ref = None
        variants = [("plain (the product's default)", False, False), ("attention compiled", True, False)]
        if cuda or args.tiny:
            variants += [("whole forward compiled", False, True), ("whole forward compiled, again", False, True)]
        outs = {}
        for vname, attn, whole in variants:
            torch._dynamo.reset()
            inductor.force_disable_caches = vname.endswith("again")  # a compile of its own, not the first's from a cache
            sl.graphs = GraphTable(attention.compile_options() if whole else None)  # what ModelSlice(compiled=) makes
            attention.COMPILE, attention._compiled = attn, None
            t0 = time.perf_counter()
            capture(sl, n_logits, window, cuda)
            out = frame()  # on the CPU: the compile happens here
            setup = time.perf_counter() - t0
            ms = timed(frame, n, cuda)
            ref = out if ref is None else ref
            diff = (out.float() - ref.float()).abs().max().item()
            again = ""
            if vname.endswith("again"):
                again = str(torch.equal(out, outs["whole forward compiled"]))
            outs[vname] = out
            kept = "" if not whole else "yes" if sl.graphs.compile is not None else "no: plain"
            print(f"| {label} | {vname} | {ms:.2f} | {setup:.1f} | {diff:.3g} | {again} | {kept} |", flush=True)
        attention.COMPILE, attention._compiled = False, None
        del sl
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
