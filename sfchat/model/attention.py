"""The slices' attention, registered with transformers' attention interface as ``"sfchat"``.

Contract
--------
A slice's decoder layers are transformers' own; their attention modules call ``attention``
with the mask their cache's ``begin`` returned (``kv.StaticKV``):

* an additive mask tensor (the draft, and every slice without one row count): transformers' own
  SDPA attention, unchanged;
* a ``kv.Blocks`` (the draft's tree forwards over a long window, ``kv.StaticKV.in_blocks``): that
  mask's window in blocks side by side, merged by their log-sum-exp (``in_blocks``);
* a ``kv.Attend`` (a one-shape slice's, ``ModelSlice(rows=)``): canonical attention, in parts
  merged by their log-sum-exp in float32, in one fixed order. (1) The context part: every row
  against the window's slots in blocks of ``kv.BLOCK``, masked to the slots below the row's own
  positions, as one fused kernel call over the blocks side by side (the query heads of a key head
  stacked as rows, so keys are never repeated; the blocks give the GPU as many more thread blocks
  to run at once); the blocks are summed pairwise (``pairwise``), so a block past the row's
  context, weighing exactly nothing, changes nothing: the window does not matter. (2) The row's
  own part: its last ``SPAN`` positions, gathered in position order from wherever they sit, as
  one fused kernel call too (a batch of one row each). A row's arithmetic then depends only on its
  query, on the context's keys at their positions and on its own keys in order: not on the other
  rows, on the slots its ancestors hold, on the window, or on how far the context was committed
  when it ran.

Both parts run on a GPU through PyTorch's memory-efficient attention kernel (which returns the
log-sum-exp), on a CPU as the same arithmetic in float32 matrix products. On a GPU, with
``compile_on_gpu(True)``, the rest of ``canonical`` (the own part's gathers, the merge) is compiled
by torch.compile (``on_gpu``): a few fused kernels in place of ~20 small ones a layer, one
compiled program per shape, so every forward of one shape runs the same code whatever the mode;
the merge's only reduction over blocks is a maximum (exact in any order) and its sums stay
``pairwise``'s explicit additions, rounded as written. A GPU that cannot compile runs the plain
functions for the whole process (warned once). Knows nothing of trees, frames or the wire.
"""

from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sfchat.model import kv
from sfchat.model.kv import Attend, Blocks

NAME = "sfchat"
COMPILE = False  # on a GPU, run ``canonical`` compiled by torch.compile (``on_gpu``; ``compile_on_gpu``)
# Inductor's options for that compile (those the installed version knows): its code rounds as written
# (no fused multiply-adds: ``emulate_precision_casts``) and no timing picks a choice that changes numbers
OPTIONS: dict = {"emulate_precision_casts": True, "deterministic": True}
RECOMPILES = 1024  # compiled programs allowed for ``canonical``: a slice's windows x segments x models in a process


def fused(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (B, H, M, D) against ``key``/``value`` (B, H, N, D) under the additive ``bias``
    (B, H, M, N; any strides, the last one 1): the normalised output (B, H, M, D; the inputs' dtype
    on a GPU, float32 on a CPU) and the log-sum-exp (B, H, M) in float32. One fused kernel call on
    a GPU (a row with no key gets an arbitrary result: the caller weighs it by nothing)."""
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, key, value, bias, True, 0.0, False, scale=scale)
        return out, lse[..., :q.shape[2]]
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale + bias.float()
    return torch.matmul(torch.softmax(scores, -1), value.float()), torch.logsumexp(scores, -1)


def context_part(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float,
                 block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (1, Hkv, m, D) against ``key``/``value`` (1, Hkv, T, D) under ``bias`` (m, T), in blocks
    of ``block`` slots (default ``kv.BLOCK``) run side by side (T a multiple of it): per block, the
    normalised output (T / block, Hkv, m, D) and the log-sum-exp (T / block, Hkv, m) (``fused``)."""
    block = block or kv.BLOCK
    _, kv_heads, m, dim = q.shape
    blocks = key.shape[2] // block
    keys = key[0].view(kv_heads, blocks, block, dim).transpose(0, 1)  # (blocks, Hkv, block, D)
    values = value[0].view(kv_heads, blocks, block, dim).transpose(0, 1)
    bias = bias.view(m, blocks, block).transpose(0, 1)[:, None].expand(blocks, kv_heads, m, block)
    return fused(q.expand(blocks, kv_heads, m, dim), keys, values, bias, scale)


def in_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, how: Blocks, scale: float
              ) -> torch.Tensor:
    """``query`` (1, H, n, D) against ``key``/``value`` (1, Hkv, W, D) under ``how.bias`` (group * n,
    W): the (1, n, H, D) output in the query's dtype. The window in blocks of ``how.block`` slots
    side by side (``context_part``: the query heads of a key head stacked as rows, so keys are never
    repeated), merged by their log-sum-exp in float32 (a block a row sees nothing of weighs 0: its
    bias is the dtype's lowest, never -inf). The draft's step over a long window: on an H100, 24
    layers of a 0.5B draft's 9 rows over 4096 slots took 0.86 ms in blocks of 128 against 1.92 with
    the keys repeated for SDPA (bench/draft_attention.py)."""
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    outs, lses = context_part(query.reshape(1, kv_heads, group * n, dim), key, value, how.bias, scale, how.block)
    weights = torch.exp(lses - lses.amax(0))  # (blocks, Hkv, group * n)
    out = (outs.float() * weights[..., None]).sum(0) / weights.sum(0)[..., None]
    return out.view(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(1, n, heads, dim).to(query.dtype)


def own_part(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, how: Attend, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (n, Hkv, group, D), each row's query heads by key head, against its own ``SPAN`` keys
    gathered in position order from ``key``/``value`` (1, Hkv, T, D): the output (n, Hkv, group, D)
    and the log-sum-exp (n, Hkv, group) (``fused``, a batch of one row each)."""
    n, kv_heads, group, _ = q.shape
    keys = key[0].transpose(0, 1)[how.keys].transpose(1, 2)  # (n, Hkv, SPAN, D), gathered (n, SPAN, Hkv, D)
    values = value[0].transpose(0, 1)[how.keys].transpose(1, 2)
    bias = how.own[:, None, None, :].expand(n, kv_heads, group, kv.SPAN)  # a row always sees itself
    return fused(q, keys, values, bias, scale)


def pairwise(x: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of ``x`` (consumed: summed in place) in one fixed order: halves of the
    next power of two, added pairwise, level by level. Parts past the last that holds anything
    must be negative zeros, and then change nothing: the sum of the first ``c`` parts is the same
    whatever -0.0 follow them (``x + -0.0 == x`` for every x, -0.0 and +0.0 included, where
    ``-0.0 + 0.0`` is +0.0), so a row's context part is the same over any window that holds it."""
    c = x.shape[0]
    while c > 1:
        half = 1 << ((c - 1).bit_length() - 1)  # half < c <= 2 * half
        x[:c - half] += x[half:c]
        c = half
    return x[0]


def canonical(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, how: Attend, scale: float
              ) -> torch.Tensor:
    """``query`` (1, H, n, D) against the whole buffers ``key``/``value`` (1, Hkv, T, D), its
    context part over the first ``how.bias.shape[1]`` slots: the (1, n, H, D) output in the query's
    dtype (query head h reads key head h // (H / Hkv))."""
    _, heads, n, dim = query.shape
    kv_heads, width = key.shape[1], how.bias.shape[1]
    group = heads // kv_heads
    outs, lses = context_part(query.reshape(1, kv_heads, group * n, dim), key[:, :, :width], value[:, :, :width],
                              how.bias, scale)
    blocks = outs.shape[0]
    own, own_lse = own_part(query[0].view(kv_heads, group, n, dim).permute(2, 0, 1, 3), key, value, how, scale)
    out = merge(outs.view(blocks, kv_heads, group, n, dim), lses.view(blocks, kv_heads, group, n),
                how.context[:, None, None, :], own.permute(1, 2, 0, 3), own_lse.permute(1, 2, 0))
    return out.permute(2, 0, 1, 3).reshape(1, n, heads, dim).to(query.dtype)


def merge(outs: torch.Tensor, lses: torch.Tensor, has: torch.Tensor, own: torch.Tensor, own_lse: torch.Tensor
          ) -> torch.Tensor:
    """The context part's blocks ``outs`` (blocks, Hkv, group, n, D) and ``lses`` (blocks, Hkv,
    group, n), of which a row has keys where ``has`` (blocks, 1, 1, n), and the own part ``own``
    (Hkv, group, n, D) and ``own_lse``, merged by their log-sum-exp in float32: (Hkv, group, n, D).
    Plain tensor arithmetic, one fixed order (``pairwise``)."""
    lses = torch.where(has, lses, float("-inf"))  # a block without a row's keys weighs nothing (a kernel's lse: 0)
    top = torch.maximum(lses.amax(0), own_lse)  # the own part is never empty: a row sees itself
    weights = torch.exp(lses - top)  # exactly 0 for a block without the row's keys
    context = pairwise(torch.where(has[..., None], outs * weights[..., None], -0.0))
    total = pairwise(weights)  # never negative: +0.0 trails them as exactly
    mine = torch.exp(own_lse - top)
    return (context + own * mine[..., None]) / (total + mine)[..., None]


_compiled = None  # ``canonical`` compiled (the first GPU call), or the plain function where that failed
_proven = False  # the compiled function has run once: a later failure is an error, not a fallback
# torch's names for the recompile settings, newest first (older releases call them cache_size_limit ...)
LIMITS = (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit"))


def allow_recompiles(n: int) -> None:
    """Let dynamo keep ``n`` compiled programs of one function (one per shape) and ``n`` in all,
    whatever its defaults: the limits are only raised."""
    import torch._dynamo as dynamo

    for names in LIMITS:
        name = next((x for x in names if hasattr(dynamo.config, x)), None)
        if name is not None:
            setattr(dynamo.config, name, max(getattr(dynamo.config, name), n))


def compile_on_gpu(on: bool) -> None:
    """Whether a GPU runs ``canonical`` compiled (the head's ``--compile-attention``; off by default).
    The head sets it once, before its first forward; a tail as each hello says, before it loads and
    captures the slice for it (the setting is part of the slice's identity): the forwards of a
    slice all run one code."""
    global COMPILE
    COMPILE = bool(on)


def on_gpu():
    """What runs ``canonical`` on a GPU: compiled by torch.compile (each shape its own program; more
    shapes than ``RECOMPILES`` raise rather than quietly run another code: dynamo's recompile
    settings are raised and made strict for the whole process), or the plain function with
    ``COMPILE`` off or where compiling failed at the first call (then for the whole process, so that
    every forward of a shape runs one code). An option of ``OPTIONS`` the installed Inductor lacks
    is left out, warned."""
    global _compiled
    if not COMPILE:
        return canonical
    if _compiled is None:
        import torch._dynamo as dynamo
        allow_recompiles(RECOMPILES)
        for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, True)
                break
        _compiled = torch.compile(canonical, dynamic=False, fullgraph=True, options=compile_options() or None)
    return _compiled


def compile_options() -> dict:
    """``OPTIONS`` less those the installed Inductor lacks (warned): what a target's compiled code
    is compiled with (canonical attention here, a slice's whole forwards: ``ModelSlice(compiled=)``)."""
    from torch._inductor import config as inductor

    options = {k: v for k, v in OPTIONS.items() if hasattr(inductor, k)}
    if len(options) < len(OPTIONS):
        warnings.warn(f"the target compiles without {sorted(set(OPTIONS) - set(options))}: this torch's Inductor "
                      f"lacks them", RuntimeWarning, stacklevel=2)
    return options


def run_on_gpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, how: Attend, scale: float
               ) -> torch.Tensor:
    """``canonical`` as ``on_gpu`` runs it; where compiling or the first compiled call fails (a GPU
    or an install that cannot compile), warned once, the plain function from then on."""
    global _proven
    if _proven or not COMPILE:
        return on_gpu()(query, key, value, how, scale)
    try:
        run = on_gpu()
    except Exception as exc:  # noqa: BLE001 - an install that cannot even set up the compile
        run = _uncompiled(exc)
    if run is canonical:
        return canonical(query, key, value, how, scale)
    try:
        out = run(query, key, value, how, scale)
    except Exception as exc:  # noqa: BLE001 - whatever stops compiling: the plain function, for the process
        return _uncompiled(exc)(query, key, value, how, scale)
    _proven = True
    return out


def _uncompiled(exc: Exception):
    """The plain function, from now on for the whole process, after ``exc`` stopped compiling."""
    global _compiled
    warnings.warn(f"canonical attention runs uncompiled ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3)
    _compiled = canonical
    return canonical


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(attention_mask, Attend):
        run = run_on_gpu if query.device.type == "cuda" else canonical
        return run(query, key, value, attention_mask, scale), None
    if isinstance(attention_mask, Blocks):
        return in_blocks(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, attention)
