"""Log-probabilities along one shared token path (teacher forcing), and how far one run's are from another's.

A reference records, at every position of the path, its top-k token ids and their log-probabilities; a run
under test records its log-probabilities of those same ids and its own top-k. The error is |Δ log-prob| over
the reference's top-k, in nats; top-1 agreement is the share of positions where both pick the same token.
"""

from __future__ import annotations

import torch

from evident.workflow.core.verdicts import NEAR_TIE

# what the reference runs in, whatever the campaign's dtype: the truth the engine's log-probs are held to
REFERENCE_DTYPE = "float32"
# the near-tie margin is raised in bf16/fp16 to the margin error transformers' own run exceeds at 5% of positions
NOISE_QUANTILE = 0.95


class Positions:
    """Accumulates the log-probs of every row, position by position, as a forced pass hands out logits."""

    def __init__(self, top_k: int, ref_ids: list[list[int]] | None = None):
        self.top_k, self.ref_ids = top_k, ref_ids
        self.rows: list[dict] | None = None

    def __call__(self, logits: torch.Tensor) -> None:
        """logits [B, T, vocab] of the next T positions of every row."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = lp.topk(min(self.top_k, lp.shape[-1]), dim=-1)
        if self.rows is None:
            self.rows = [{"top_ids": [], "top_logprobs": [], "ref_logprobs": []} for _ in range(lp.shape[0])]
        start = len(self.rows[0]["top_ids"])
        ref = None
        if self.ref_ids is not None:
            ids = torch.tensor(self.ref_ids[start:start + lp.shape[1]], device=lp.device)
            ref = lp.gather(-1, ids[None].expand(lp.shape[0], -1, -1))
        for r, row in enumerate(self.rows):
            row["top_ids"] += top.indices[r].tolist()
            row["top_logprobs"] += top.values[r].tolist()
            if ref is not None:
                row["ref_logprobs"] += ref[r].tolist()


def reference(logits: torch.Tensor, top_k: int) -> dict:
    """A reference's record of one path from its logits [T, vocab]: top-k ids and log-probs per position."""
    pos = Positions(top_k)
    pos(logits[None])
    row = pos.rows[0]
    return {"top_ids": row["top_ids"], "top_logprobs": row["top_logprobs"]}


def at(logits: torch.Tensor, ids: list[list[int]]) -> dict:
    """Another run's log-probs of the reference's ids (logits [T, vocab]), and its own top-1."""
    pos = Positions(1, ids)
    pos(logits[None])
    row = pos.rows[0]
    return {"ref_logprobs": row["ref_logprobs"], "top1": [t[0] for t in row["top_ids"]]}


def dtypes(campaign: str) -> list[str]:
    """The dtypes the engine's forced runs take: the campaign's, then float32 (the logic check's) unless the same."""
    return list(dict.fromkeys([campaign, REFERENCE_DTYPE]))


def errors(ref: dict, got_logprobs: list[list[float]], got_top1: list[int]) -> dict:
    """|Δ log-prob| over the reference's top-k per position, and whether the top-1 agrees, as tensors."""
    want = torch.tensor(ref["top_logprobs"], dtype=torch.float64)
    got = torch.tensor(got_logprobs, dtype=torch.float64)
    if want.shape != got.shape:
        raise ValueError(f"log-probs of {tuple(got.shape)} (positions, top-k) against the reference's {tuple(want.shape)}")
    top1 = torch.tensor([ids[0] for ids in ref["top_ids"]]) == torch.tensor(got_top1)
    return {"delta": (got - want).abs(), "top1": top1}


def row_errors(ref: dict, row: dict) -> dict:
    """`errors` of one recorded row: a Positions row, or `at`'s record (its `top1`)."""
    top1 = row["top1"] if "top1" in row else [ids[0] for ids in row["top_ids"]]
    return errors(ref, row["ref_logprobs"], top1)


def stats(deltas: list[dict]) -> dict:
    """mean, p99 and max |Δ| and top-1 agreement over several `errors` results pooled."""
    d = torch.cat([e["delta"].flatten() for e in deltas])
    t = torch.cat([e["top1"].flatten() for e in deltas]).double()
    return {"mean": float(d.mean()), "p99": float(torch.quantile(d, 0.99)), "max": float(d.max()),
            "top1_agreement": float(t.mean()), "positions": int(t.numel())}


def transformers_errors(oracle: dict) -> dict[str, dict]:
    """Per case, `errors` of transformers' own run in the campaign's dtype against the float32 reference (the oracle
    stage's record, oracle/hf.json); none in a float32 campaign."""
    if oracle["dtype"] == REFERENCE_DTYPE:
        return {}
    return {c["name"]: row_errors(c["reference"], c["same_dtype"]) for c in oracle["cases"]}


def near_tie_margin(dtype: str, transformers: dict[str, dict], fixed: float | None) -> tuple[float, dict | None]:
    """The near-tie margin below which two correct computations may pick different tokens (parity's verdicts, the
    bench's rows check) and, where it was measured, how: `fixed` where the campaign gives one
    (parity.near_tie_margin), else the dtype's floor (NEAR_TIE), which a bf16/fp16 campaign raises to the noise
    transformers itself shows on these paths (`transformers_errors`): the NOISE_QUANTILE of the error its own run in
    that dtype makes on a margin (|Δ| of the float32 reference's top-1 log-prob plus its top-2's), over every position
    of every case. Random weights make that noise large: on Moonlight's shape (H200, bf16) a median of 0.8 nats and a
    95th percentile of 4.45, where the fixed floor of 0.5 called a divergence at a margin of 1.06 decisive."""
    floor = NEAR_TIE[dtype]
    if fixed is not None or not transformers:
        return (floor if fixed is None else fixed), None
    errors = torch.cat([e["delta"][:, :2].sum(-1) for e in transformers.values()])
    noise = float(torch.quantile(errors, NOISE_QUANTILE, interpolation="lower"))  # a value some position has
    return max(floor, noise), {"quantile": NOISE_QUANTILE, "positions": len(errors), "transformers_margin_error": noise,
                               "floor": floor}
