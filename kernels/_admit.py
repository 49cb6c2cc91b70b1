"""What every kernel's admission predicate checks first: where the tensors live and how they are laid out.

A kernel runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``,
read when Triton is imported, as Triton itself does). Predicates return ``None`` to admit, else the
reason the call falls back to the torch reference.
"""
from __future__ import annotations

import os

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_reason(*tensors: torch.Tensor) -> str | None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return f"tensors on several devices: {sorted(str(d) for d in devices)}"
    device = devices.pop()
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return f"device {device} (kernels run on cuda, or on cpu under TRITON_INTERPRET=1)"


def dtype_reason(name: str, dtype: torch.dtype, allowed=FLOATS) -> str | None:
    return None if dtype in allowed else f"{name} dtype {dtype} not in {[str(d) for d in allowed]}"
