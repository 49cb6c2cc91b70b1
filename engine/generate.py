"""Greedy batched generation over the engine's Transformer.

Each prompt is prefilled alone (one row of the cache), then all unfinished rows decode together,
one batched forward per step. Under expert parallelism every rank calls ``generate`` in lockstep with the same
prompts; the combined logits are identical on every rank, so every rank picks the same tokens. Usage::

    python -m engine.generate --checkpoint DIR --prompt-ids 1,2,3 --max-new-tokens 16
    torchrun --nproc_per_node 2 -m engine.generate --backend host-staged --checkpoint DIR --prompt-ids 1,2,3
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model import LatentCache, Transformer

MAX_BATCH = 8


@dataclass
class Generation:
    tokens: list[list[int]]  # per row: generated ids only (EOS included when emitted)
    margins: list[list[float]]  # per row, per step: top1 - top2 fp32 logit of the engine


def _pick(logits: torch.Tensor, argmax=None) -> tuple[list[int], list[float]]:
    """Greedy over fp32 logits [B, V]: argmax (first max on ties; ``argmax`` a kernel doing the same)
    and top1-top2 margin."""
    logits = logits.float()
    ids = argmax(logits) if argmax is not None else torch.argmax(logits, dim=-1)
    if logits.shape[-1] > 1:
        top2 = torch.topk(logits, 2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
    else:
        margins = [float("inf")] * logits.shape[0]
    return ids.tolist(), margins


def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
             eos_token_id: int | list[int] | None = None,
             progress: Callable[[int, int], None] | None = None,
             stop: Callable[[int, list[int]], bool] | None = None) -> Generation:
    """Greedy-decode up to ``max_new_tokens`` for each prompt (1..8 prompts, any lengths).

    A row stops after emitting an EOS id (kept in its output) or at max_new_tokens.
    ``progress(step, total)`` is called after the prefill (step 1) and after each batched decode step,
    with step = tokens generated so far by the longest row and total = max_new_tokens.
    ``stop(row, tokens)`` is called after each token a row emits (tokens: its generated ids so far); when it
    returns true the row stops there (a server's stop strings, streaming).
    """
    if not isinstance(prompts, (list, tuple)) or not 1 <= len(prompts) <= MAX_BATCH:
        n = len(prompts) if isinstance(prompts, (list, tuple)) else type(prompts).__name__
        raise ValueError(f"batch size must be between 1 and {MAX_BATCH} prompts, got {n}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    limit = model.args.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {i}: {len(p)} prompt tokens + {max_new_tokens} new tokens exceed "
                             f"max_position_embeddings={limit}")
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    B = len(prompts)
    out = Generation(tokens=[[] for _ in range(B)], margins=[[] for _ in range(B)])
    if max_new_tokens == 0:
        return out

    device = model.embed_tokens.weight.device
    max_len = max(len(p) for p in prompts) + max_new_tokens
    graph = model.graph_decode  # decodes every row each step (a finished row's results are not read)
    cache = graph.cache(B, max_len) if graph is not None else LatentCache.for_model(model, B, max_len)
    done = [False] * B

    def emit(rows: list[int], logits: torch.Tensor) -> None:
        ids, margins = _pick(logits, model.argmax_kernel)
        for r, t, m in zip(rows, ids, margins):
            out.tokens[r].append(t)
            out.margins[r].append(m)
            done[r] = t in eos or len(out.tokens[r]) >= max_new_tokens
            if stop is not None and stop(r, out.tokens[r]):
                done[r] = True

    with torch.inference_mode():
        for r, p in enumerate(prompts):  # prefill, one row at a time
            tokens = torch.tensor([list(p)], dtype=torch.long, device=device)
            logits = model(tokens, cache, torch.tensor([r], device=device))
            emit([r], logits[:, -1])
        if progress is not None:
            progress(1, max_new_tokens)
        for step in range(2, max_new_tokens + 1):
            active = [r for r in range(B) if not done[r]]
            if not active:
                break
            if graph is not None:
                logits = graph.step(cache, torch.tensor([t[-1] for t in out.tokens], device=device))
                emit(active, logits[active])
            else:
                tokens = torch.tensor([[out.tokens[r][-1]] for r in active], dtype=torch.long, device=device)
                logits = model(tokens, cache, torch.tensor(active, device=device))
                emit(active, logits[:, -1])
            if progress is not None:
                progress(step, max_new_tokens)
    return out


def main(argv: list[str] | None = None) -> None:
    from .checkpoint import load_model

    ap = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompt-ids", required=True, action="append",
                    help="comma-separated token ids; repeat for a batch")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--eos-token-id", type=int, action="append", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backend", default="single", choices=["single", "host-staged", "collective"],
                    help="single device, or expert parallel (launch with torchrun --nproc_per_node N; rank 0 prints)")
    a = ap.parse_args(argv)
    prompts = [[int(x) for x in p.split(",") if x.strip()] for p in a.prompt_ids]
    ep = None
    if a.backend != "single":
        from .parallel import init_from_env

        try:
            ep = init_from_env(a.backend, a.device)
        except RuntimeError as e:
            ap.error(str(e))
    try:
        model = load_model(a.checkpoint, device=a.device if ep is None else ep.device, dtype=getattr(torch, a.dtype),
                           ep=ep)
        gen = generate(model, prompts, a.max_new_tokens, a.eos_token_id)
    finally:
        if ep is not None:
            ep.close()
    if ep is None or ep.rank == 0:
        for row in gen.tokens:
            print(",".join(map(str, row)))


if __name__ == "__main__":
    main()
