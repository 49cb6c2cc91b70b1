"""The device's read bandwidth: the rate the bandwidth floors (workflow/bench/floor.py, the kernel benches) divide bytes by;
and its matrix-product rate (`matmul_rate`), which the prefill's floor divides its FLOPs by.

A decode step only reads its weights, so its floor is their bytes over what a plain read moves: this kernel, eight
launches between the CUDA events. The floors used one timed device-to-device copy before, about 12% slower on an H200
(kernels/KERNELS.md "The read bandwidth").
"""
from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

BLOCK = 4096  # fp32 values a program: 16 KB, at the plateau of 4-16 KB a program (one warp of 1 KB: 25% slower)
CHAIN = 8  # launches between the events: one launch's ramp and tail cost ~3% of 1 GiB's read


@triton.jit
def _read_kernel(x, out, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    v = tl.load(x + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
    tl.store(out + pid, tl.sum(v, axis=0))


def block_sums(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each BLOCK of the flat fp32 `x` summed into `out`: every byte of `x` read once."""
    _read_kernel[(out.numel(),)](x, out, BLOCK=BLOCK, num_warps=8)
    return out


def median_seconds(fn, device: str, repeats: int, chain: int = 1) -> float:
    """Seconds one of `chain` back-to-back calls of fn takes: the median of `repeats` timings after two warm-ups (CUDA
    events on a GPU, the wall clock elsewhere)."""
    cuda = device.startswith("cuda")
    times = []
    for _ in range(repeats + 2):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(chain):
            fn()
        if cuda:
            b.record()
            b.synchronize()
        times.append((a.elapsed_time(b) / 1e3 if cuda else time.perf_counter() - t0) / chain)
    return statistics.median(times[2:])


def read_bandwidth(device: str, mib: int = 1024, repeats: int = 10) -> float:
    """Bytes read per second: CHAIN reads of a `mib` MiB buffer (median_seconds). On CUDA the reads are block_sums,
    checked first against torch's sum; elsewhere torch's sum (a CPU campaign's floor exercises the machinery only)."""
    n = ((mib << 20) // 4) // BLOCK * BLOCK
    x = torch.randn(n, device=device)
    read = x.sum
    if device.startswith("cuda"):
        out = torch.empty(n // BLOCK, device=device)
        got, want = block_sums(x, out).double().sum().item(), x.double().sum().item()
        if abs(got - want) > 1e-3 * n ** 0.5:
            raise RuntimeError(f"the read kernel summed {got}, not {want}: its bandwidth would be no read's")
        read = lambda: block_sums(x, out)  # noqa: E731
    return n * 4 / median_seconds(read, device, repeats, CHAIN)


MATMUL_N, CPU_MATMUL_N = 8192, 256  # matmul_rate's square product: a GPU's fills the chip, a CPU's shows the machinery


def matmul_rate(device: str, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of one square matrix product in `dtype` (torch's, so cuBLAS's on a GPU), 2 n^3 a product: CHAIN products
    between the events (median_seconds), on fresh random inputs (zeros run faster than data)."""
    n = MATMUL_N if device.startswith("cuda") else CPU_MATMUL_N
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / median_seconds(lambda: torch.matmul(a, b, out=out), device, repeats, CHAIN)


def copy_bandwidth(mib: int = 512) -> float:
    """What the floors used before: one device-to-device copy of `mib` MiB timed alone, bytes read plus written per
    second (median of 10)."""
    src = torch.randn((mib << 20) // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), "cuda", 10)


def main() -> None:
    """`python -m evident.kernels.hbm` on a GPU: the read bandwidth the floors use, beside the copy they used before."""
    rows = [(f"read, {mib} MiB, {CHAIN} launches between events (the floors')", read_bandwidth("cuda", mib))
            for mib in (1024, 2048)]
    rows.append(("copy, 512 MiB, one launch, read + written (the floors' before 2026-12-03)", copy_bandwidth()))
    for name, bw in rows:
        print(f"{name:80} {bw / 1e9:7,.0f} GB/s")


if __name__ == "__main__":
    main()
