"""What the evidence ran on: package versions and the device, never host, user or home paths."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import subprocess

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "snakemake",
            "mlflow-skinny", "numpy", "triton")


def resolve_device(device: str) -> str:
    """`auto` picks CUDA when present; `cuda` without a GPU is an error naming the fix."""
    import torch  # here, not above: the campaign's check (every snakemake start, each cluster job's) needs no torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was requested but no CUDA GPU is visible; use device: cpu or auto")
    return device


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def describe(device: str) -> dict:
    import torch  # as in resolve_device

    env = {
        "python": platform.python_version(),
        "os": platform.system(),
        "machine": platform.machine(),
        "packages": {p: _version(p) for p in PACKAGES},
        "device": device,
        "cuda": torch.version.cuda,
    }
    if device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["driver"] = _driver()
    else:
        env["cpu_count"] = os.cpu_count()
    return env


def triton_missing() -> str | None:
    """Why the engine's Triton paths cannot run here, or None. Triton has no macOS build (pyproject installs it on
    Linux only)."""
    if importlib.util.find_spec("triton") is None:
        return (f"Triton is not installed here ({platform.system()} {platform.machine()}; it is built for Linux "
                "only): use the torch path, or run this campaign on Linux")
    return None


def require_interpreter(what: str) -> None:
    """The Triton kernels on a CPU run through Triton's interpreter, whose switch Triton reads when it is first
    imported (torch imports it): set in the process, it comes too late and nested kernels fail. The rules set it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{what} on a CPU runs Triton's interpreter: set TRITON_INTERPRET=1 in the environment "
                           "before Python starts (the Snakemake rules do)")
