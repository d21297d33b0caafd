"""``--device`` on a machine without the device: the refusal says why and what to do instead."""

from __future__ import annotations

import pytest
import torch

from sfchat import UserError
from sfchat.model.devices import resolve_devices


@pytest.mark.parametrize("build, why, fix", [
    (None, "this torch is a CPU-only build", "install the CUDA build of torch"),
    ("12.8", "check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES", "install the CUDA build of torch that matches"),
])
def test_cuda_without_a_gpu_names_the_cause_and_the_fixes(monkeypatch, build, why, fix):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)
    for name in ("cuda", "cuda:1", "cuda:0,cuda:1"):
        with pytest.raises(UserError) as caught:
            resolve_devices(name)
        message = str(caught.value)
        assert message.startswith(f"device {name.split(',')[0]!r} requested but no CUDA GPU is visible ({why}): "
                                  "use --device cpu, or "), message
        assert fix in message
