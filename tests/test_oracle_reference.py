"""Where the oracle's float32 reference runs (workflow/stages/oracle.py): the campaign's GPU where the float32
weights fit beside what the campaign-dtype model frees, else the CPU, and the evidence says which."""

from __future__ import annotations

import torch

from evident.workflow.stages import oracle


class Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(numel, dtype=dtype), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype


def test_float32_reference_goes_where_it_fits(monkeypatch):
    bf16 = Model(torch.bfloat16, 1000)  # 2,000 bytes now, 4,000 in float32
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (3000, 10_000))  # 3,000 free + 2,000 freed > 4,400
    assert oracle.reference_device(bf16, "cuda") == ("cuda", "the campaign's device")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2000, 10_000))  # 4,000 < 4,400: the CPU, and why
    device, why = oracle.reference_device(bf16, "cuda")
    assert device == "cpu" and "do not fit" in why and "cuda" in why


def test_cpu_and_float32_campaigns_stay_on_their_device():
    assert oracle.reference_device(Model(torch.bfloat16, 10), "cpu") == ("cpu", "the campaign's device")
    assert oracle.reference_device(Model(torch.float32, 10), "cuda:0") == ("cuda:0", "the campaign's device")
