"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A kernel launched with PDL may start while the previous kernel in the stream is still finishing: its launch
and prologue overlap that kernel's tail instead of following it (~2 µs a launch inside a CUDA graph on an
H200, engine/DECODE.md). Every kernel launched this way calls ``wait`` before it touches memory that an
earlier kernel may write or read (its inputs, its outputs, scratch reused from the graph's pool); only
weights, which no kernel writes, may be loaded before it. ``wait`` returns once the previous kernel has
finished and its writes are visible, and then lets the next kernel start its own prologue. Since every
kernel waits, the order of the stream holds transitively, as without PDL; a kernel launched the ordinary way
(cuBLAS, torch) simply starts after its predecessor ends.

    @triton.jit
    def k(..., PDL: tl.constexpr):
        w0 = tl.load(weights...)   # optional: constants only
        pdl.wait(PDL)
        ...
    k[grid](..., **pdl.flags(x.device))
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ._admit import interpreting

# Switched off (``disabled``) by the benchmarks to measure what it saves, and by the profile stage.
ENABLED = True


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    """PDL needs sm_90+; asked once per device, not on every launch."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def flags(device: torch.device) -> dict:
    """The launch's keyword arguments: the kernel's PDL constexpr, and Triton's launch_pdl where it is used."""
    on = ENABLED and device.type == "cuda" and not interpreting() and _hopper_or_later(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@contextlib.contextmanager
def disabled():
    """Ordinary launches inside: what PDL saves, and kernel durations a profiler can take as each kernel's own."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


__all__ = ["ENABLED", "disabled", "flags", "wait"]
