"""CUDA-graph capture: the one helper behind the benchmarks, the overlap screen and the engine's graph decode step."""
from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable, calls: int = 1, warmup: int = 1, undo: Callable | None = None):
    """(graph, the last call's output): ``calls`` calls of fn captured in one CUDA graph.

    fn runs ``warmup`` times eagerly on a side stream first (PyTorch's capture recipe), so Triton compiles and
    cuBLAS initialises and picks its kernels outside the capture. The warm-up runs for real: ``undo`` (on the
    current stream, after it) puts back state it advanced, before the capture records. The graph reads and
    writes the addresses fn used while captured: refill those buffers to replay on new inputs; the output is
    the captured call's own tensor, rewritten by every replay.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if undo is not None:
        undo()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # synchronises the device before it starts recording
        for _ in range(calls):
            out = fn()
    return graph, out
