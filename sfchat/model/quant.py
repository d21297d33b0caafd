"""4-bit NF4 weights (bitsandbytes) for the decoder layers of a slice.

Contract
--------
``QUANT_MODES`` names what a slice may be loaded as: ``"none"`` (dense, in the slice dtype) or
``"nf4"`` (QLoRA's 4-bit NormalFloat with double quantisation: blocks of 64 weights share one
absmax, and the absmaxes are themselves quantised to 8 bits). ``check_mode(name)`` validates a
name from the flags or from a head's hello.

``quantize_linears(module, compute_dtype)`` replaces every ``nn.Linear`` inside ``module`` — whose
weights are already loaded, on their device — by a ``bitsandbytes.nn.Linear4bit`` computing in
``compute_dtype`` (the slice dtype: bf16, fp16 on a T4, fp32 on the CPU), and drops the dense
weights. The slice loader calls it one decoder layer at a time, so loading needs the dense copy
of one layer at most on top of the quantised ones. Embeddings, norms and the lm_head stay dense
(as transformers' own 4-bit loading leaves them). Quantisation is deterministic: the same
weights give the same 4-bit tensors on every machine, so a head and a tail that both load
``nf4`` hold exactly the model the head asked for.

``NF4_BYTES_PER_WEIGHT`` is what one quantised weight costs, for the memory estimate.
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


def check_mode(name) -> str:
    if name not in QUANT_MODES:
        raise UserError(f"unknown quantisation {name!r} (choose from {', '.join(QUANT_MODES)})")
    return name


def _no_kernel_hub_warning(record) -> bool:
    """bitsandbytes, importing on a CPU with AVX512-BF16, tries to fetch a faster kernel from
    the Hugging Face hub and logs a warning on every run when it cannot; its own CPU kernel is
    used then, which is all sfchat needs. Dropped, once per process, before the import."""
    return "gemm_4bit_forward from kernels-community" not in str(record.msg)


def _bnb():
    import logging

    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if _no_kernel_hub_warning not in cpu_ops.filters:
        cpu_ops.addFilter(_no_kernel_hub_warning)
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # not installed, or a broken native library
        raise UserError(f"4-bit loading needs bitsandbytes ({type(exc).__name__}: {exc}): "
                        "pip install bitsandbytes, or drop --load-in-4bit") from None
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


def quantize_linears(module: nn.Module, compute_dtype: torch.dtype) -> int:
    """Swap every ``nn.Linear`` below ``module`` for its NF4 version; returns how many."""
    swaps = [(parent, name, child) for parent in module.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, nf4_linear(child, compute_dtype))
    return len(swaps)


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` holds any 4-bit linear layer."""
    return any(type(m).__name__ == "Linear4bit" for m in module.modules())
