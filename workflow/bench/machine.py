"""The machine probe: a fixed small workload timed before every measured repeat of a bench cell (stages bench and
serve_bench), so that a claim between two directories can tell a change of the machine (load, clocks, another
tenant) from a change of the code (benchstats.directional_claim)."""

from __future__ import annotations

import functools
import time

import torch

WORKLOAD = {"matmul": 128, "copy_mb": 1, "rounds": 64}
"""`rounds` times an n x n float32 matmul and a copy of `copy_mb` MB, of fixed inputs. Small ops, as a decode step's
are, so that load on the host's cores slows it as it slows the step (on a 2-core CPU machine about 3 ms quiet; a
bench repeat of the default campaign is 30-60 ms). A cell records it (`probe`): two cells whose workloads differ
make no claim."""


@functools.cache
def _inputs(device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    n, words = WORKLOAD["matmul"], WORKLOAD["copy_mb"] * 2**18  # float32: 4 bytes a word
    a, b, src = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g), torch.randn(words, generator=g)
    return a.to(device), b.to(device), src.to(device), torch.empty(words, device=device)


def probe_ms(device: str) -> float:
    """The workload's wall time on `device` (ms, the host's clock around a synchronized device)."""
    a, b, src, dst = _inputs(device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(WORKLOAD["rounds"]):
        torch.mm(a, b)
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3
