"""Screen factories as a user writes them (`screens: [{name, module: "tests.userscreens:doubling"}]`), for
tests/test_screens.py: a correct one, one whose B is a perturbed kernel, and ones that break the contract."""

from __future__ import annotations

import torch

from evident.kernels.overlap import Screen

ROWS, COLS = 8, 32  # tiny: the CPU runs them eagerly


def _inputs(device: str):
    """The tensors A and B read, and draw(i): input set i written into them in place (seeded by i)."""
    x = torch.empty(ROWS, COLS, device=device)

    def draw(i: int) -> None:
        g = torch.Generator(device=device).manual_seed(1000 + i)
        x.copy_(torch.randn(x.shape, generator=g, device=device))

    return x, draw


def _b(x: torch.Tensor, perturb: bool):
    inf = torch.full((), float("inf"), device=x.device)  # made here: a CUDA graph capture cannot copy from the host

    def b(side):
        """x + x on a side stream (the same bits as 2 * x) beside the row sums on the current stream."""
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # fork: this input set is written
        with torch.cuda.stream(side):  # None (the CPU): no-op
            y = x + x
            if perturb:  # the defect: one element one ulp off
                y[0, 0] = torch.nextafter(y[0, 0], inf)
        s = x.sum(1)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)  # join before the outputs are read
        return [y, s]
    return b


def doubling(device: str) -> Screen:
    """A doubles x with a multiply, B with an add on a side stream: bitwise equal by IEEE arithmetic."""
    x, draw = _inputs(device)
    return Screen(draw, lambda: [x * 2, x.sum(1)], _b(x, perturb=False), streams=1, names=["doubled", "row_sum"],
                  variants={"A": "2 * x, then the row sums", "B": "x + x on a side stream beside the row sums"})


def perturbed(device: str) -> Screen:
    """As doubling, but B's doubled output has one element one ulp off on every input set."""
    x, draw = _inputs(device)
    return Screen(draw, lambda: [x * 2, x.sum(1)], _b(x, perturb=True), streams=1, names=["doubled", "row_sum"])


def plain(device: str):
    """The tuple form, no side stream, default names."""
    x, draw = _inputs(device)
    return draw, (lambda: [x.neg()]), (lambda: [-x])


def wrong_return(device: str):
    return {"draw": None}


def different_outputs(device: str) -> Screen:
    x, draw = _inputs(device)
    return Screen(draw, lambda: [x * 2, x.sum(1)], lambda: [x + x])


def raises(device: str):
    raise RuntimeError("no weights here")


def no_device():
    return None


NOT_CALLABLE = 3
