"""transformers' own model of a checkpoint, loaded one way for the oracle, the quality stage and the `hf` bench.

Native transformers code only (no remote code). A tensor transformers could not place is an error, not a
silent random init: it would make every comparison against this model meaningless.
"""

from __future__ import annotations

from pathlib import Path

import torch

from evident.engine.checkpoint import mtp_tensor
from evident.engine.config import load_args
from evident.workflow.models import checkpoints


def load(ckpt_dir: Path, dtype: str, device: str, **options):
    """(tokenizer, model in eval mode on `device`); options go to from_pretrained (`experts_implementation`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt_dir)
    # device_map loads straight onto the GPU (no 31 GB host copy first); accelerate does that part
    placement = {"device_map": device} if device != "cpu" else {}
    model, info = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=checkpoints.DTYPES[dtype],
                                                       output_loading_info=True, **placement, **options)
    # multi-token-prediction layers are no part of the causal LM (transformers ignores DeepSeek-V3's at a 61-layer
    # model's index only, DeepSeek-V4's mtp.* module always): unexpected there, and not run by either side
    args = load_args(ckpt_dir)
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys", []) if not mtp_tensor(k, args)]
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise checkpoints.CheckpointInvalid(f"transformers could not load {ckpt_dir} cleanly: {bad}")
    return tok, model.to(device).eval()


def free(model) -> None:
    model.to("meta")  # drops the weights now, not when the last reference goes
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
