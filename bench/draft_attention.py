"""The draft's attention at a step's few rows over a long window: which way of computing it is fastest.

A draft's expansion step runs ``rows`` (9, 17 or 33) query rows against a window of 1024-4096 cache
slots in each of its layers, under an additive mask (the tree's). In the shapes of Qwen2.5-0.5B (14
query heads, 2 key/value heads, 64 dims), bf16, each way below runs once per layer (24 calls)
inside one CUDA graph, replayed; the figure is ms per step (24 calls):

  * ``repeat + SDPA``: what transformers' SDPA attention does with a mask (the keys and values
    repeated to every query head, then ``scaled_dot_product_attention``, its default backend);
    ``repeat + SDPA (efficient)`` / ``(cudnn)``: the same with one backend forced;
  * ``heads as rows``: the query heads of a key head stacked as rows (7 x rows against each key
    head: nothing repeated), the mask repeated per head, one memory-efficient kernel call;
  * ``heads as rows, blocks of B``: the same, the window cut in blocks of B slots run side by side
    (more thread blocks at once: what a long window at few rows needs), merged by their
    log-sum-exp (``model.attention.fused``, as canonical attention's context part).

Every way's output is compared with a float32 reference (the max abs difference is printed).

Run from the repository root:  python3 bench/draft_attention.py [--tiny]  (--tiny: CPU, checks the script)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfchat.model.attention import fused  # noqa: E402
from quant_rows import graphed  # noqa: E402
from verify_breakdown import timed  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 14, 2, 64, 24


def reference(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = q.float() @ k.transpose(-1, -2) * scale + mask.float()
    return torch.softmax(scores, -1) @ v


def repeat_sdpa(backend=None):
    def run(q, k, v, mask, scale):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale)
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale)
    return run


def stacked(q, mask):
    """q (1, H, n, D) -> (1, Hkv, group * n, D); the mask (n, W) -> (group * n, W)."""
    _, heads, n, dim = q.shape
    group = heads // KV_HEADS
    return q.reshape(1, KV_HEADS, group * n, dim), mask.repeat(group, 1)


def heads_as_rows(block=0):
    def run(q, k, v, mask, scale):
        _, heads, n, dim = q.shape
        qs, m = stacked(q, mask)
        m = m.to(q.dtype)
        if not block:
            out, _ = fused(qs, k, v, m[None, None].expand(1, KV_HEADS, *m.shape), scale)
        else:
            blocks = k.shape[2] // block
            keys = k[0].view(KV_HEADS, blocks, block, dim).transpose(0, 1)
            values = v[0].view(KV_HEADS, blocks, block, dim).transpose(0, 1)
            bias = m.view(m.shape[0], blocks, block).transpose(0, 1)[:, None].expand(blocks, KV_HEADS, m.shape[0], block)
            outs, lses = fused(qs.expand(blocks, KV_HEADS, *qs.shape[2:]), keys, values, bias, scale)
            top = lses.amax(0)
            w = torch.exp(lses - top)
            out = (outs.float() * w[..., None]).sum(0) / w.sum(0)[..., None]
            out = out[None]
        return out.view(1, KV_HEADS, heads // KV_HEADS, n, dim).reshape(1, heads, n, dim)
    return run


def graphed_ms(fn, inputs, calls: int, cuda: bool) -> float:
    """ms per step: ``LAYERS`` calls of ``fn`` in one CUDA graph, replayed ``calls`` times."""
    def step():
        for _ in range(LAYERS):
            fn(*inputs)
    replay = graphed(step) if cuda else step
    if isinstance(replay, str):  # the capture's error
        raise RuntimeError(replay)
    return timed(replay, calls, cuda)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dev, dt = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    from torch.nn.attention import SDPBackend
    ways = {"repeat + SDPA": repeat_sdpa(), "repeat + SDPA (efficient)": repeat_sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    if cuda:
        ways["repeat + SDPA (cudnn)"] = repeat_sdpa(SDPBackend.CUDNN_ATTENTION)
    ways["heads as rows"] = heads_as_rows()
    for b in (128, 256, 512):
        ways[f"heads as rows, blocks of {b}"] = heads_as_rows(b)
    windows, rows_list = ((1024, 2048, 4096), (9, 17, 33)) if cuda else ((512,), (9,))
    scale = DIM ** -0.5
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}, {dt}, {LAYERS} calls a step, "
          f"{HEADS}/{KV_HEADS} heads of {DIM}\n")
    print("| rows | window | context | " + " | ".join(ways) + " |")
    print("| --- | --- | --- |" + " --- |" * len(ways))
    g = torch.Generator(device="cpu").manual_seed(0)
    for rows in rows_list:
        for window in windows:
            context = window * 3 // 4
            q = torch.randn(1, HEADS, rows, DIM, generator=g).to(dev, dt)
            k = torch.randn(1, KV_HEADS, window, DIM, generator=g).to(dev, dt)
            v = torch.randn(1, KV_HEADS, window, DIM, generator=g).to(dev, dt)
            mask = torch.full((rows, window), float("-inf"))
            mask[:, :context] = 0.0
            for r in range(rows):  # each row sees the context and a few slots of the tree
                mask[r, context + r % 5] = 0.0
            mask = mask.to(dev)
            ref = reference(q, k, v, mask, scale)
            cells = []
            for name, fn in ways.items():
                try:
                    err = (fn(q, k, v, mask, scale).float() - ref).abs().max().item()
                    cells.append(f"{graphed_ms(fn, (q, k, v, mask, scale), args.calls, cuda):.3f} (err {err:.0e})")
                except Exception as exc:  # noqa: BLE001 - a backend this GPU or build lacks
                    cells.append(f"n/a ({type(exc).__name__})")
            print(f"| {rows} | {window} | {context} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
