"""Quantised weights (bitsandbytes) for the decoder layers of a slice: 4-bit NF4 or 8-bit int8.

Contract
--------
``QUANT_MODES`` names what a slice may be loaded as: ``"none"`` (dense, in the slice dtype),
``"nf4"`` (QLoRA's 4-bit NormalFloat with double quantisation: blocks of 64 weights share one
absmax, and the absmaxes are themselves quantised to 8 bits) or ``"int8"`` (LLM.int8()'s
vector-wise int8 without the outlier split: each output row of a weight scaled to int8 by its
absmax; each input row quantised the same way at every call, multiplied in int8 by cuBLASLt on a
GPU, the product rescaled to the input's dtype; the input passes through fp16 on the way).
``check_mode(name)`` validates a name from the flags or from a head's hello.

``quantize_linears(module, compute_dtype, quant)`` replaces every ``nn.Linear`` inside ``module``
— whose weights are already loaded, on their device — by a ``bitsandbytes.nn.Linear4bit``
computing in ``compute_dtype`` (the slice dtype: bf16, fp16 on a T4, fp32 on the CPU) or a
``Linear8bitLt`` (threshold 0: no data-dependent outlier columns, so it is captured in CUDA
graphs like the rest), and drops the dense weights. The slice loader calls it one decoder layer
at a time, so loading needs the dense copy of one layer at most on top of the quantised ones.
Embeddings, norms and the lm_head stay dense (as transformers' own quantised loading leaves
them). Quantisation is deterministic: the same weights give the same quantised tensors on every
machine, so a head and a tail that both load a mode hold exactly the model the head asked for.

``bytes_per_weight(quant, dtype, min_in)`` is what one weight of a linear costs, for the memory
estimate (``min_in``: the smallest input width among the layer's linears, which int8's per-row
scales are spread over). Why int8 beside NF4: past one row bitsandbytes' NF4 runs at 4-6x its
weight read on an H100 while int8 runs at its (twice larger) read, 2.5-3.5x faster per frame
(bench/RESULTS.md, 2026-12-06 second session); it holds twice NF4's bytes.
This module knows nothing about checkpoints, the wire or graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from sfchat import UserError
from sfchat.protocol.handshake import QUANT_MODES

BLOCKSIZE = 64
# 4 bits + one 8-bit absmax per block + one fp32 absmax per 256 blocks (double quantisation)
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / BLOCKSIZE + 4 / (BLOCKSIZE * 256)
LINEAR_CLASSES = ("Linear4bit", "Linear8bitLt")


def bytes_per_weight(quant: str, dtype: torch.dtype, min_in: int) -> float:
    """Bytes of one linear weight stored as ``quant`` (int8: a byte and its row's fp32 scale)."""
    if quant == "nf4":
        return NF4_BYTES_PER_WEIGHT
    if quant == "int8":
        return 1 + 4 / max(1, min_in)
    return dtype.itemsize


def check_mode(name) -> str:
    if name not in QUANT_MODES:
        raise UserError(f"unknown quantisation {name!r} (choose from {', '.join(QUANT_MODES)})")
    return name


def _no_kernel_hub_warning(record) -> bool:
    """bitsandbytes, importing on a CPU with AVX512-BF16, tries to fetch a faster kernel from
    the Hugging Face hub and logs a warning on every run when it cannot; its own CPU kernel is
    used then, which is all sfchat needs. Dropped, once per process, before the import."""
    return "gemm_4bit_forward from kernels-community" not in str(record.msg)


def _no_fp16_cast_warning(record) -> bool:
    """The int8 matmul logs, at every call whose input is not fp16, that it casts the input to
    fp16 to quantise it: what the contract says int8 does. Dropped, not repeated per layer."""
    return "inputs will be cast from" not in str(record.msg)


def _bnb():
    import logging

    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if _no_kernel_hub_warning not in cpu_ops.filters:
        cpu_ops.addFilter(_no_kernel_hub_warning)
    matmuls = logging.getLogger("bitsandbytes.autograd._functions")
    if _no_fp16_cast_warning not in matmuls.filters:
        matmuls.addFilter(_no_fp16_cast_warning)
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # not installed, or a broken native library
        raise UserError(f"quantised loading needs bitsandbytes ({type(exc).__name__}: {exc}): "
                        "pip install bitsandbytes, or drop --load-in-4bit / --load-in-8bit") from None
    return bnb


def nf4_linear(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    """An NF4 ``Linear4bit`` holding ``linear``'s weights (quantised on the weights' device)."""
    bnb = _bnb()
    weight = linear.weight.data
    device = weight.device
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                          device="meta")
    # Params4bit quantises when it is moved to a real device; ``to`` on the same device does it too
    q.weight = bnb.nn.Params4bit(weight, requires_grad=False, blocksize=BLOCKSIZE, compress_statistics=True,
                                 quant_type="nf4", module=q).to(device)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
    return q.eval()


def int8_linear(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    """An int8 ``Linear8bitLt`` (threshold 0) holding ``linear``'s weights, quantised where they are."""
    bnb = _bnb()
    q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            has_fp16_weights=False, threshold=0.0, device="meta")
    rows, scales, _ = bnb.functional.int8_vectorwise_quant(linear.weight.data.to(torch.float16))
    weight = bnb.nn.Int8Params(rows, requires_grad=False, has_fp16_weights=False)
    weight.CB, weight.SCB = rows, scales
    q.weight = weight
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
    return q.eval()


def quantize_linears(module: nn.Module, compute_dtype: torch.dtype, quant: str = "nf4") -> int:
    """Swap every ``nn.Linear`` below ``module`` for its ``quant`` version; returns how many."""
    make = {"nf4": nf4_linear, "int8": int8_linear}[check_mode(quant)]
    swaps = [(parent, name, child) for parent in module.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, make(child, compute_dtype))
    return len(swaps)


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` holds any quantised linear layer."""
    return any(type(m).__name__ in LINEAR_CLASSES for m in module.modules())
