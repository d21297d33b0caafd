"""What one frame costs the head, part by part: the draft's expansion step and the head slice's tree forward.

Random-weight slices in the shapes of Qwen2.5-7B (the head's half: layers [0, 14) with the
embedding) and Qwen2.5-0.5B (the whole draft) are built on the GPU (no checkpoint), a context is
prefilled, and every figure is the mean of many calls (CUDA-synchronised wall time):

  * the draft's expansion step (``Drafter.expand``: one forward of ``width + 1`` rows over its
    scratch, the top-8 continuations of each row, one host sync), replayed from its CUDA graph, at
    widths 8, 16 and 32, and (width 8, the product's) with the forward compiled by torch.compile
    under the graph, for each window (the product's way; ``--max-context`` + its pool slots), and
    with dynamo free to make the window's size symbolic (one program for the windows after the
    first: fewer compiles at the start); each with the attention over a long window in blocks
    (``Drafter(blocks_from=)``, the product's) and without (SDPA); ``--draft-contexts`` measures
    each captured variant after several contexts (windows); the product's way with the layers'
    q/k/v and gate/up projections merged (``model.fused``, the product's default; the others
    unfused), each variant on a fresh slice;
    ``--profile-draft`` adds each step's kernel count and top kernels;
  * the head slice's tree forward over its scratch at 9, 33 and 65 rows, replayed from its graph;
    the same rows as a plain causal forward (no tree mask, no scratch: the attention over the
    context alone); the 65-row forward's matrix multiplications alone; the host's parts of a frame
    (building the tree's inputs, the hidden states to bytes, the wire encoding);
  * the kernels that take the most time in one eager 65-row tree forward (torch.profiler);
  * one row count against each forward at its own size (``--frame-rows 64``, a GPU's default,
    against ``0``; on a GPU canonical attention also compiled by torch.compile, as
    ``--compile-attention`` runs it and with Inductor's own numerics): the same weights as slices
    of 4096 + scratch slots, a 64-row tree frame graphed, after contexts of ``--context``, 2000
    and 4000 tokens: masked SDPA over the smallest window that holds the context against canonical
    attention (``model.attention``: its context part in blocks over the window holding the
    context); whether each frame comes out the same bits over its window and over all slots; and
    the kernels of one eager canonical forward (compiled on a GPU).

Run from the repository root:  python3 bench/frame_cost.py [--tiny] [--context 500] [--no-compile] [--rows-only]
    [--max-context 2048] [--profile-draft] [--draft-only] [--draft-contexts 500,1500,3000] [--variants 0,1]
(--tiny: CPU, tiny shapes: checks the script, measures nothing)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verify_breakdown import SHAPES, TINY, gemm_ms, profiled, random_slice, timed  # noqa: E402
from sfchat.engine.draft import BLOCKS_FROM, Drafter  # noqa: E402
from sfchat.engine.scratch import Scratch  # noqa: E402
from sfchat.model import attention  # noqa: E402
from sfchat.engine.speculator import hidden_bytes  # noqa: E402
from sfchat.protocol import wire  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

HEAD_POOL = 9 * 64 + 1  # the GPU default's head scratch: 8 frames in flight and one being built, 64 nodes each
DRAFT_POOL = 513


def tree_rows(n: int, base: int) -> list[tuple[int, int, list[int]]]:
    """A best-first-like tree of ``n`` nodes below a root at ``base - 1``: (position, key, ancestors);
    each node's parent is node (i - 1) // 4 (four children each), as a 64-node frame looks."""
    rows, ancestors = [], {}
    for i in range(n):
        up = [] if i == 0 else ancestors[(i - 1) // 4] + [(i - 1) // 4]
        ancestors[i] = up
        rows.append((base + len(up), i, up))
    return rows


def draft_rows(width: int, context: int):
    """An expansion step: one committed node catching up and ``width`` nodes below it."""
    return [(5, context, "c", [])] + [(7 + i, context + 1, i, ["c"]) for i in range(width)]


def compiled_programs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def compile_dynamic(dynamic):
    """``torch.compile`` called with ``dynamic=dynamic`` inside (the product's draft asks for False:
    None lets dynamo make the window's size symbolic once it has seen two)."""
    original = torch.compile
    torch.compile = lambda fn, **kw: original(fn, **(kw | dict(dynamic=dynamic)))
    try:
        yield
    finally:
        torch.compile = original


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rows-only", action="store_true", help="only the one-row-count comparison")
    ap.add_argument("--max-context", type=int, default=2048, help="the draft's cache (the product's default: 4096)")
    ap.add_argument("--profile-draft", action="store_true", help="the top kernels of each expansion step (profiler)")
    ap.add_argument("--draft-only", action="store_true", help="only the draft's expansion steps")
    ap.add_argument("--draft-contexts", help="the draft's steps after each of these contexts (default: --context)")
    ap.add_argument("--variants", help="the draft's variants to run, by index (0 plain, 1 blocks, 2 compiled, "
                                       "3 compiled blocks, 4 compiled dynamic blocks, 5 blocks fused, "
                                       "6 compiled blocks fused (the product's); without compiling 2 is blocks "
                                       "fused; default all)")
    args = ap.parse_args()
    cuda = not args.tiny and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = TINY if args.tiny else SHAPES
    (head_name, head_shape), (draft_name, draft_shape) = list(shapes.items())
    head_shape = dict(head_shape, embed=True)
    ctx, n = args.context, args.calls if cuda else 3
    print(f"\n{'device' if cuda else 'CPU (tiny shapes: nothing measured)' if args.tiny else 'CPU'}: "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}, {dtype}, context {ctx}, {n} calls per figure\n")
    print("| what | ms | notes |\n| --- | --- | --- |")

    class Rows(list):
        def append(self, row):  # printed as it comes: a run cut short still shows what it measured
            print(f"| {row[0]} | {row[1]:.2f} | {row[2]} |", flush=True)

    rows_out = Rows()
    if args.rows_only:
        one_row_count(head_shape, head_name, dtype, device, cuda, ctx, n)
        return

    # -- the draft's expansion step ------------------------------------------------------------
    contexts = [int(c) for c in args.draft_contexts.split(",")] if args.draft_contexts else [ctx]
    tokens = [int(t) for t in torch.randint(0, 300, (max(contexts),))]
    variants = {"": dict(fuse=False), " (blocks)": dict(blocks=True, fuse=False)}
    if cuda and not args.no_compile:
        variants |= {" (compiled, a program per window)": dict(compile=True, fuse=False),
                     " (compiled, a program per window, blocks)": dict(compile=True, blocks=True, fuse=False),
                     " (compiled, the window dynamic, blocks)": dict(compile=True, dynamic=None, blocks=True,
                                                                     fuse=False)}
    variants |= {" (blocks, fused)": dict(blocks=True)}
    if cuda and not args.no_compile:
        variants |= {" (compiled, a program per window, blocks, fused)": dict(compile=True, blocks=True)}
    if args.variants:
        variants = {k: v for i, (k, v) in enumerate(variants.items()) if str(i) in args.variants.split(",")}
    for label, how in variants.items():
        how = dict(how)
        dynamic, blocks, fuse = how.pop("dynamic", False), how.pop("blocks", False), how.pop("fuse", True)
        for width in ((8, 16, 32) if not how and not blocks else (8,)):  # the product's width for the others
            # a fresh slice for each: fusing rebuilds the layers in place
            draft = random_slice(draft_shape, dtype, device, max_len=args.max_context + DRAFT_POOL)
            d = Drafter(draft, width=width, children=8, pool=DRAFT_POOL, blocks_from=BLOCKS_FROM if blocks else 0,
                        fuse=fuse)
            if how:  # no program of another variant may serve this one (dynamo's cache is per function)
                torch._dynamo.reset()
            t0, programs = time.perf_counter(), compiled_programs()
            if cuda:
                with compile_dynamic(dynamic):
                    d.capture(**how)
            setup, programs = time.perf_counter() - t0, compiled_programs() - programs
            for context in contexts:
                d.sync(tokens[:context])
                rows = draft_rows(width, context)
                ms = timed(lambda: d.expand(rows, Sampling()), n, cuda)
                top = profiled(lambda: d.expand(rows, Sampling()), cuda) if args.profile_draft else []
                window = draft.window_for(d.scratch.end)
                kernels = (f"; {sum(c for _, _, c in top)} kernels, {sum(us for _, us, _ in top) / 1e3:.2f} ms"
                           if top else "")
                rows_out.append((f"{draft_name} expansion step, {width + 1} rows{label}, context {context}", ms,
                                 f"window {window}; {ms / width:.2f} ms per node expanded; capture {setup:.1f} s"
                                 + (f" ({programs} programs compiled)" if how else "") + kernels +
                                 "".join(f"; {k} {us / 1e3:.2f} ms x{c}" for k, us, c in top[:8])))
                d.scratch.reset(context)
            del d, draft
            if cuda:
                torch.cuda.empty_cache()
    if args.draft_only:
        return

    # -- the head slice's tree forward -----------------------------------------------------------
    head = random_slice(head_shape, dtype, device, max_len=2048 + HEAD_POOL)
    ids = torch.randint(0, 300, (ctx,), device=device)
    head.run(ids[:ctx - 1], torch.arange(ctx - 1, device=device), end=ctx - 1)
    head.note(0, ids[:ctx - 1].tolist())
    base = ctx - 1
    scratch = Scratch(head, HEAD_POOL)
    for r in (9, 33, 65):
        if cuda:
            head.capture(r, tree=True, span=HEAD_POOL)
            head.capture(r)
        scratch.reset(base)
        rows = tree_rows(r, base)
        slots, mask = scratch.tree_inputs(rows, r, device)
        x = torch.randint(0, 300, (r,), device=device)
        tree_ms = timed(lambda: head.run(x, slots, end=scratch.reach, tree=mask), n, cuda)
        pos = torch.arange(base, base + r, device=device)
        plain_ms = timed(lambda: head.run(x, pos, end=base + r), n, cuda)
        rows_out.append((f"{head_name}: {r}-row tree forward over {HEAD_POOL} scratch slots", tree_ms,
                         f"plain causal forward of the same rows: {plain_ms:.2f} ms"))
        if r == 65:
            g, gb = gemm_ms(head, r, n, cuda)
            rows_out.append((f"{head_name}: its GEMMs alone at {r} rows", g, f"{gb:.1f} GB of weights, "
                             f"{gb / g:.2f} TB/s"))
            host = timed(lambda: (scratch.reset(base), scratch.tree_inputs(rows, r, device)), n, cuda)
            hidden = head.run(x, slots, end=scratch.reach, tree=mask)
            to_bytes = timed(lambda: hidden_bytes(hidden, "x"), n, cuda)
            raw = hidden_bytes(hidden, "x")
            enc = timed(lambda: wire.encode(wire.Forward(
                round=1, tree=1, start_pos=base, tokens=tuple(range(r)), hidden=raw, dtype=wire.DType.BFLOAT16
                if cuda else wire.DType.FLOAT32, hidden_size=hidden.shape[-1], parents=(0,) + tuple(1 + (i - 1) // 4 for i in range(1, r)), first_id=1,
                sampling=Sampling())), n, False)
            rows_out.append(("host: a frame's tree inputs (Scratch.tree_inputs)", host, ""))
            rows_out.append(("host: hidden states to bytes (device to host)", to_bytes, f"{len(raw) / 1e3:.0f} kB"))
            rows_out.append(("host: wire encoding of the FORWARD", enc, ""))

    scratch.reset(base)
    rows = tree_rows(65, base)
    slots, mask = scratch.tree_inputs(rows, 65, device)
    x = torch.randint(0, 300, (65,), device=device)
    head.forward(x, slots, window=head.window_for(scratch.reach), tree=mask)
    kernels = profiled(lambda: head.forward(x, slots, window=head.window_for(scratch.reach), tree=mask), cuda, 70)
    print("\nkernels of one eager 65-row tree forward, most time first:\n\n| kernel | µs | calls |\n| --- | --- | --- |")
    for name, us, calls in kernels[:12]:
        print(f"| {name} | {us:.0f} | {calls} |")
    del head
    one_row_count(head_shape, head_name, dtype, device, cuda, ctx, n)


def one_row_count(shape: dict, name: str, dtype, device, cuda: bool, ctx: int, n: int) -> None:
    """A 64-row tree frame: each forward at its own size (masked SDPA over the smallest window) against
    one row count (canonical attention, its context part over the window holding the context), the
    same weights, several contexts."""
    if cuda:
        torch.cuda.empty_cache()
    max_len, rows = 4096 + HEAD_POOL, 64
    slices = {"own size, masked": random_slice(shape, dtype, device, max_len),
              "64 rows, canonical": random_slice(shape, dtype, device, max_len, rows=rows)}
    variants = {"64 rows, canonical": (False, {})}  # the product's default: the plain functions
    if cuda:  # compiled (--compile-attention), and with Inductor's own numerics (fused multiply-adds)
        variants.update({"64 rows, canonical, compiled": (True, dict(attention.OPTIONS)),
                         "64 rows, canonical, compiled, Inductor's numerics": (True, {})})
    for key in variants:
        slices[key] = slices.get(key) or random_slice(shape, dtype, device, max_len, rows=rows)
    compiled = {}

    def use(key: str) -> None:  # the variant's canonical attention for what runs next
        attention.COMPILE, attention.OPTIONS = variants.get(key, variants["64 rows, canonical"])
        attention._compiled = compiled.get(key)
        attention.on_gpu()
        compiled[key] = attention._compiled
    print(f"\n{name}: a {rows}-row tree frame, graphed, {max_len} slots\n\n| context | "
          + " | ".join(f"{k} (ms)" for k in slices) + " |\n| --- |" + " --- |" * len(slices))
    for key, sl in slices.items():
        if cuda:
            use(key)
            sl.capture(rows, tree=True, span=HEAD_POOL)
    same = {}  # a frame over its window against over all slots: the same bits?
    for context in (ctx, 2000, 4000):
        cells = []
        ids = torch.randint(0, 300, (context - 1,), device=device)
        x = torch.randint(0, 300, (rows,), device=device)
        for key, sl in slices.items():
            use(key)
            sl.reset()
            sl.feed(ids, 0)
            sl.note(0, ids.tolist())
            scratch = Scratch(sl, HEAD_POOL)
            scratch.reset(context - 1)
            slots, mask = scratch.tree_inputs(tree_rows(rows, context - 1), rows, device)
            cells.append(timed(lambda: sl.run(x, slots, end=scratch.reach, tree=mask), n, cuda))
            if cuda and key in variants:
                same.setdefault(key, []).append(torch.equal(sl.run(x, slots, end=scratch.reach, tree=mask),
                                                            sl.run(x, slots, tree=mask)))
        print(f"| {context} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)
    for key, equal in same.items():
        print(f"\n{key}: the frame over its window bit-identical to it over all {max_len} slots at contexts "
              f"{ctx}, 2000, 4000: {equal}")
    key = "64 rows, canonical, compiled" if cuda else "64 rows, canonical"
    use(key)
    sl = slices[key]
    kernels = profiled(lambda: sl.forward(x, slots, window=sl.window_for(scratch.reach), tree=mask), cuda, 70)
    print(f"\nkernels of one eager {rows}-row canonical tree forward ({key}), most time first:\n\n"
          "| kernel | µs | calls |\n"
          "| --- | --- | --- |")
    for kname, us, calls in kernels[:16]:
        print(f"| {kname} | {us:.0f} | {calls} |")


if __name__ == "__main__":
    main()
