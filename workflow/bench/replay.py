"""A bench run replayed untimed, one row at a time: one teacher-forced forward of each row's prompt and the tokens
the timed run generated for it, so that nothing is read back inside a timed run (the graph path's step is one CUDA
graph).

From it, what the timed run does not say:
- the routed experts each MoE layer chose for the row at every decode step, and over its prompt's positions (the
  prefill's), for the floors of the experts actually chosen (workflow/bench/floor.py). The engine's MoE layers (DeepSeek-V2/V3, and DeepSeek-V4's hash and top-k layers)
  re-run their own router on the layer's input in a hook; transformers' routers return their choice, which a hook
  keeps. The replay is the eager forward: in a low dtype a router score within rounding of the k-th may choose
  otherwise than the timed step's kernels did, which moves the floor by an expert's bytes at most;
- the token the row alone would pick at each of its positions, for `alone_check`: a batch of distinct prompts must
  decode each row as its prompt alone does (the same-prompt contract checks instead that rows are identical).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from evident.workflow.core.verdicts import NEAR_TIE  # a batch's row against the row alone may pick differently under it

AS_ALONE, NEAR_TIES, MISMATCH = "rows_as_alone", "near_tie_differences", "row_mismatch"


@dataclass
class Row:
    experts: list[list[list[int]]]  # per decode step (2..N), per MoE layer: the k experts the row chose
    prefill: list[set[int]]  # per MoE layer: the experts its prompt's positions chose, their union
    alone: list[int]  # per generated token: the row alone's greedy pick at its position
    gaps: list[float]  # per generated token: the row alone's logit of its pick minus that of the batch's token


class ReplayError(ValueError):
    """A model whose routers the replay cannot read."""


def _keep_choice(ids: list, module, args, out) -> None:
    """transformers' router: it returns (logits, weights, expert ids) (transformers 5.24's DeepSeek-V2/V3/V4)."""
    chosen = out[-1] if isinstance(out, tuple) else None
    if not isinstance(chosen, torch.Tensor) or chosen.is_floating_point():
        raise ReplayError(f"transformers' {type(module).__name__} returned no expert ids (a tuple ending in them): "
                          "this transformers' routers are not the ones the floor reads")
    ids.append(chosen)


def _route_again(ids: list, module, args, out) -> None:
    """The engine's MoE layer: its router on the layer's input (DeepSeek-V4's layers take the token ids too, for
    hash routing)."""
    x, rest = args[0], args[1:]
    ids.append(module.route(x.reshape(-1, x.shape[-1]), *(t.reshape(-1) for t in rest))[1])


@contextlib.contextmanager
def _routers(model, hf: bool):
    """A list per MoE layer, in layer order, that each forward appends its expert ids [tokens, k] to."""
    chosen, handles = [], []
    for layer in (model.model.layers if hf else model.layers):
        # transformers' router module, or the engine's MoE layer (a dense layer has neither)
        module = getattr(layer.mlp, "gate", None) if hf else layer.mlp
        if not (isinstance(module, torch.nn.Module) if hf else hasattr(module, "route")):
            continue
        chosen.append([])
        handles.append(module.register_forward_hook(functools.partial(_keep_choice if hf else _route_again,
                                                                      chosen[-1])))
    try:
        yield chosen
    finally:
        for h in handles:
            h.remove()


def _logits(model, ids: list[int], hf: bool) -> torch.Tensor:
    """Logits [T, vocab] in fp32 of one row's forward over `ids` (an engine cache of exactly T positions)."""
    if hf:
        return model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits[0].float()
    device = model.embed_tokens.weight.device
    return model(torch.tensor([ids], device=device), model.new_cache(1, len(ids)))[0].float()


def replay(model, prompts: list[list[int]], tokens: list[list[int]], hf: bool = False) -> list[Row]:
    """Each row alone, teacher-forced along its prompt and generated tokens (at least 2). Under expert parallelism
    every rank calls it in lockstep, as it calls generate."""
    rows = []
    with torch.inference_mode(), _routers(model, hf) as chosen:
        for prompt, gen in zip(prompts, tokens):
            logits = _logits(model, list(prompt) + list(gen[:-1]), hf)[len(prompt) - 1:]  # predicts gen[i] at i
            ids = [layer.pop().tolist() for layer in chosen]
            # decode step s (2..N) feeds gen[s-2], at position len(prompt) + s - 2
            experts = [[layer[len(prompt) + i] for layer in ids] for i in range(len(gen) - 1)]
            prefill = [set().union(*layer[:len(prompt)]) for layer in ids]
            alone = logits.argmax(dim=-1)
            picked = torch.tensor(gen, device=logits.device)
            gaps = (logits.gather(1, alone[:, None]) - logits.gather(1, picked[:, None]))[:, 0]
            rows.append(Row(experts, prefill, alone.tolist(), gaps.tolist()))
    return rows


def decide(diffs: list[dict], sure, tie: float) -> tuple[dict | None, str]:
    """The rows rule over a batch's differences from its rows alone: the difference both computations were surest
    of (`sure(d)`: the smaller of their preferences), and `row_mismatch` where that exceeds the near-tie margin `tie`,
    `near_tie_differences` where none does, `rows_as_alone` where there is none."""
    worst = max(diffs, key=sure, default=None)
    return worst, AS_ALONE if not diffs else MISMATCH if sure(worst) > tie else NEAR_TIES


def alone_check(rows: list[Row], tokens: list[list[int]], dtype: str, margins: list[list[float]] | None = None,
                near_tie: tuple[float, dict | None] | None = None) -> dict:
    """Each row's tokens against its prompt alone (`replay`'s picks along the row's own tokens, so one early
    difference does not hide the steps after it). A difference is a defect (`row_mismatch`: a batch changed a
    decisive token, as a row reading another row's cache would) where the row alone prefers its own pick by more
    than the near-tie margin and, where the timed run's own top-1/top-2 `margins` are known (the engine's),
    the batch preferred its pick by more than it too: two computations of one row that differ by rounding err each
    way cannot both be that sure of different tokens unless err exceeds the margin. Smaller ones are recorded
    (`near_tie_differences`): a batch changes the shapes of a step's products, and with them their rounding.
    `near_tie`: the campaign's margin and how it was measured (logprobs.near_tie_margin, parity's), else the
    dtype's floor."""
    tie, noise = near_tie or (NEAR_TIE[dtype], None)
    diffs = [{"row": r, "step": i + 1, "token": gen[i], "alone_token": row.alone[i], "gap": row.gaps[i],
              "batch_margin": margins[r][i] if margins else None}
             for r, (row, gen) in enumerate(zip(rows, tokens)) for i in range(len(gen)) if row.alone[i] != gen[i]]
    worst, verdict = decide(diffs, lambda d: min(d["gap"], d["batch_margin"]) if margins else d["gap"], tie)
    return {"rule": "each row against its prompt alone, teacher-forced along the row's tokens: a different pick "
                    "where the row alone prefers its own by more than the near-tie margin (logits), and the batch "
                    "its own by more than it where the batch's margins are known, fails the cell",
            "verdict": verdict, "near_tie_margin": tie, "near_tie_noise": noise, "rows": len(rows),
            "rows_as_alone": len(rows) - len({d["row"] for d in diffs}), "differences": len(diffs),
            "first": diffs[0] if diffs else None, "largest": worst}
