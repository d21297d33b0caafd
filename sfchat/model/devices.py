"""Where and in what a node computes: devices from the flags, the draft's GPU, the dtype.

Contract: ``resolve_device(name)`` / ``resolve_devices(name)`` turn ``--device`` into torch
devices ("cpu", "cuda", "cuda:N", "cuda:0,cuda:1" for a slice spread over two GPUs of the
node, "cpu,cpu" for the same segments on the CPU), with a ``UserError`` naming the fix for a device this machine does not have;
``default_draft_device`` puts the draft on a GPU the target slice does not use when there is
one; ``pick_dtype`` chooses bf16 where the GPU has it, fp16 on older GPUs (T4), fp32 on the
CPU, and ``runnable_dtype`` what a GPU without native bf16 computes a bf16 request in.
Loads nothing.
"""

from __future__ import annotations

import torch

from sfchat import UserError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # also the lower-case names of wire.DType


def pick_dtype(device: torch.device, override: str | None = None) -> torch.dtype:
    """bf16 where the GPU supports it, fp16 on older GPUs (T4), fp32 on the CPU."""
    if override and override != "auto":
        if override not in DTYPES:
            raise UserError(f"unknown dtype {override!r} (choose from auto, {', '.join(DTYPES)})")
        return DTYPES[override]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.float32


def runnable_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float16 where it is bfloat16 on a GPU without native bf16 (a T4 asked by
    its peer to match a bf16 machine: emulated bf16 would run several times slower)."""
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        return torch.float16
    return dtype



def resolve_device(name: str | None) -> torch.device:
    if not name or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r} requested but {no_gpu_reason()}")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise UserError(f"device {name!r} does not exist ({torch.cuda.device_count()} GPUs visible)")
    elif dev.type != "cpu":
        raise UserError(f"unsupported device {name!r} (use cpu, cuda or cuda:N)")
    return dev


def no_gpu_reason() -> str:
    """Why torch sees no CUDA GPU here, and the fixes, for a refusal of ``--device cuda``."""
    if torch.version.cuda is None:
        return ("no CUDA GPU is visible (this torch is a CPU-only build): use --device cpu, or install the CUDA "
                "build of torch (https://pytorch.org/get-started/locally/) on a machine with a GPU")
    return ("no CUDA GPU is visible (check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES): use --device cpu, "
            "or install the CUDA build of torch that matches the driver")


def resolve_devices(name: str | None) -> list[torch.device]:
    """One device, or the GPUs of this node that one slice spreads over ("cuda:0,cuda:1"), or the
    CPU named more than once ("cpu,cpu"): the slice then runs as that many segments on the CPU,
    exactly the code of a slice spread over that many GPUs, so a two-GPU layout's answers can be
    checked on a machine without GPUs."""
    devices = [resolve_device(part.strip()) for part in (name or "").split(",")] if name and "," in name \
        else [resolve_device(name)]
    if len(devices) > 1:
        if len({d.type for d in devices}) > 1:
            raise UserError(f"--device {name!r}: a slice is spread over GPUs (cuda:0,cuda:1) or run as segments "
                            "on the CPU (cpu,cpu), not both")
        if devices[0].type == "cuda" and len({d.index or 0 for d in devices}) != len(devices):
            raise UserError(f"--device {name!r} names the same GPU twice")
    return devices


def default_draft_device(devices: list[torch.device]) -> torch.device:
    """The draft's device: a GPU the target slice does not use when there is one (a T4 pair)."""
    if devices[0].type != "cuda":
        return devices[0]
    used = {d.index or 0 for d in devices}
    spare = [i for i in range(torch.cuda.device_count()) if i not in used]
    return torch.device("cuda", spare[0]) if spare else devices[-1]
