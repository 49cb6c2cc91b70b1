"""Trained checkpoints (`checkpoint.source: trained`): the synthetic checkpoint of the same seed, trained with
transformers' own model of the family (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV4ForCausalLM:
checkpoints.hf_classes) on the arithmetic word problems of workflow/models/arithmetic.py (train split
only), written as the synthetic writer writes: per-expert names, name order, the same shards and tokenizer.

Rows are `seq_len` tokens: BOS, then `Question: … Answer: … #### N` pairs back to back, the GSM8K shot format.
The loss is taken on the answers and on each literal `Question:` (so the model learns to stop where the quality
contract's stop string is), not on the question bodies: their names and numbers are random, entropy no model can
learn, and on the tiny model an all-token loss left held-out accuracy at 0/32 after 600 steps where this one
reaches 28/32. Rows must be as long as the prompts the model will see: positions it never trained on are
noise (seq_len 128 gave 0/32 on 217-token prompts).

On the CPU a family whose query and value head sizes differ (`Family.pads_values`) trains through transformers' own sdpa attention with the values zero-padded to the
queries' head size (`PADDED_SDPA`, registered with transformers' AttentionInterface): torch's CPU flash kernel takes
equal head sizes only, so with the tiny model's 24-wide queries and 16-wide values sdpa fell back to its math path,
and a step took ~20% longer (0.234 against 0.186 s on two cores, 2026-12-03). The padding's columns attend to
zeros and are cut off; loss and gradients agree with the unpadded path to ~1e-7.

Deterministic: the init and the data order come from the seed; on the CPU training runs `train.threads` threads
(fixed, not the machine's count: a reduction's order follows its threads) with torch's deterministic
algorithms, and no op draws random numbers (no dropout). The same seed, config, data and steps then give
byte-identical files on the same platform (tests/test_training.py). On CUDA, deterministic algorithms are
asked for with warn_only (some backward ops have no deterministic kernel); how far two runs differ there is
measured, not assumed (docs/campaigns.md "Trained checkpoints").
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from evident.workflow.core.evidence import write_json
from evident.workflow.models import arithmetic, checkpoints, families

PROGRESS_SECONDS = 5.0
# The trainer's numerics, in a trained checkpoint's cache key (estimate.cache_dir): a change that trains other weights
# from the same spec (2: PADDED_SDPA) bumps it, so that a cache of the old weights is not taken for the new
VERSION = 2
PADDED_SDPA = "evident_padded_sdpa"
BETAS = (0.9, 0.95)
CLIP = 1.0


def deterministic(device: str, threads: int) -> None:
    import torch

    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any matmul
    else:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=device == "cuda")
    # Deterministic mode also fills every new empty tensor with NaN, in case an op reads memory it never wrote: none
    # here does (the same bits with and without), and the fills were ~7% of a CPU step.
    torch.utils.deterministic.fill_uninitialized_memory = False


def rows(tok, seed: int, batch: int, seq_len: int, bos: int):
    """Endless (ids, labels) batches of [batch, seq_len]; labels are -100 where no loss is taken."""
    import torch

    problems = arithmetic.stream(seed, "train")
    head = tok.encode("Question:", add_special_tokens=False).ids
    while True:
        ids, keep = [], []
        for _ in range(batch):
            row, mask = [bos], [False]
            while len(row) < seq_len + 1:
                p = next(problems)
                body = tok.encode(f" {p['question']}\nAnswer:", add_special_tokens=False).ids
                answer = tok.encode(f" {p['answer']}\n\n", add_special_tokens=False).ids
                row += head + body + answer
                mask += [True] * len(head) + [False] * len(body) + [True] * len(answer)
            ids.append(row[: seq_len + 1])
            keep.append(mask[: seq_len + 1])
        x, m = torch.tensor(ids), torch.tensor(keep)
        labels = x[:, 1:].masked_fill(~m[:, 1:], -100)
        yield x[:, :-1], labels


def padded_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention on values zero-padded to the queries' head size, the padding cut off after."""
    from torch.nn.functional import pad
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width = value.shape[-1]
    out, weights = sdpa_attention_forward(module, query, key, pad(value, (0, max(0, query.shape[-1] - width))),
                                          attention_mask, **kwargs)
    return out[..., :width], weights


def lr_at(step: int, spec: dict) -> float:
    """Linear warm-up, then cosine decay to zero."""
    warm = min(1.0, (step + 1) / max(1, spec["warmup"]))
    return spec["lr"] * warm * 0.5 * (1 + math.cos(math.pi * step / spec["steps"]))


def progress_line(done: int, steps: int, loss: float, elapsed: float) -> str:
    """A line of training progress: the time left is the mean step so far times the steps left."""
    line = f"step {done}/{steps}: loss {loss:.4f}, {elapsed:.0f}s"
    if done < steps:
        m, s = divmod(round(elapsed / done * (steps - done)), 60)
        line += f", about {f'{m}m{s:02d}s' if m else f'{s}s'} left"
    return line


def train(out_dir: str | Path, hf_config: dict, seed: int, init_std: float, dtype: str, spec: dict,
          device: str = "cpu", progress: Callable[[str], None] | None = None) -> Path:
    """Train `spec["steps"]` steps from the synthetic init of `seed` and write the checkpoint to out_dir."""
    import torch

    say = progress or (lambda line: None)
    deterministic(device, spec["threads"])
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="evident-init-") as tmp:
        checkpoints.write_synthetic(tmp, hf_config, seed, init_std, "float32", init_device=device)
        _, model_cls = checkpoints.hf_classes(checkpoints.family(hf_config))
        attention = {}
        if families.of(hf_config).pads_values and device == "cpu":  # CUDA's sdpa kernels take unequal sizes
            from transformers import AttentionInterface

            AttentionInterface.register(PADDED_SDPA, padded_sdpa)
            attention = {"attn_implementation": PADDED_SDPA}
        model = model_cls.from_pretrained(tmp, dtype=torch.float32, **attention).to(device)
    cfg = checkpoints.full_config(hf_config, dtype)
    tok, _, _ = checkpoints.build_tokenizer(cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=BETAS, weight_decay=0.0)
    batches = rows(tok, seed, spec["batch_size"], spec["seq_len"], cfg["bos_token_id"])
    losses, t0, last = [], time.monotonic(), time.monotonic()
    for step in range(spec["steps"]):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, spec)
        x, y = (t.to(device) for t in next(batches))
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
        if time.monotonic() - last >= PROGRESS_SECONDS or step + 1 == spec["steps"]:
            last = time.monotonic()
            say(progress_line(step + 1, spec["steps"], losses[-1], last - t0))
    out.mkdir(parents=True, exist_ok=True)
    tail = losses[-max(1, len(losses) // 10):]
    state = checkpoints.saved_state(model, checkpoints.family(hf_config), bool(cfg.get("tie_word_embeddings")))
    checkpoints.write_weights(out, state, dtype, say)
    # No time or host figure here: the file is part of the checkpoint's bytes.
    write_json(out / "evident_trained.json", {
        "seed": seed, "init_std": init_std, "dtype": dtype, "device": device, "train": spec,
        "data": {"generator": "workflow/models/arithmetic.py", "split": "train", "tokens": spec["steps"] * spec["batch_size"] * spec["seq_len"]},
        "loss": {"first": round(losses[0], 6), "last": round(losses[-1], 6), "last_tenth_mean": round(sum(tail) / len(tail), 6)},
        "torch": torch.__version__})
    checkpoints.write_model_files(out, cfg)
    return out
