"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A kernel launched with PDL may start while the previous kernel in the stream is still finishing: its launch
and prologue overlap that kernel's tail instead of following it (~2 µs a launch inside a CUDA graph on an
H200, docs/decode-log.md). Every kernel launched this way calls ``wait`` before it touches memory that an
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

A launch may also hand part of its output over before its end (``publish``, ``wait_or_acquire``): the writing program
stores it, sets a flag (release) and only then lets the next launch start, while the launch's other programs let it
start at once; programs of the next launch that need only that part read the flag instead of waiting.
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
def wait_only(PDL: tl.constexpr):
    """Wait for the previous kernel, not yet letting the next one launch (``publish`` or ``launch_dependents`` does)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel launch (after ``wait_only``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch."""
    wait_only(PDL)
    launch_dependents(PDL)


@triton.jit
def _fence():
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [tl.full([1], 0, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish(flag, PDL: tl.constexpr):
    """After this program's stores: flag = 1 (release, GPU scope), then let the next launch start. A program of a
    launch that waited with ``wait_only`` calls it once; the others call ``launch_dependents``, so the next launch's
    programs start after the flag is set."""
    tl.debug_barrier()  # every thread's stores before the release (kernels/_count.py's pattern)
    tl.atomic_xchg(flag, 1, sem="release", scope="gpu")
    launch_dependents(PDL)


@triton.jit
def wait_or_acquire(flag, PDL: tl.constexpr):
    """For a program that reads only what the previous launch published: on at once if the flag reads 1 (an
    acquire fence after it: the published stores are visible), else wait for that launch's end (``wait``)."""
    if tl.load(flag, volatile=True) != 0:
        if PDL:
            _fence()
    else:
        wait_only(PDL)
    launch_dependents(PDL)


__all__ = ["ENABLED", "disabled", "flags", "launch_dependents", "publish", "wait", "wait_only", "wait_or_acquire"]
