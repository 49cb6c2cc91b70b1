"""A checkpoint directory's safetensors tensors, read by name for both loaders (checkpoint.py: DeepSeek-V2 and V3;
v4_checkpoint.py: DeepSeek-V4), and the model they are seated in."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from .config import V4, CheckpointError, ModelArgs, V4Args

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_V4_MTP = re.compile(r"(^|\.)mtp\.")  # DeepSeek-V4's multi-token-prediction module (transformers ignores it too)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's fills as no-ops: a model built to be given a checkpoint's tensors needs none. On the meta
    device a random fill runs through torch._refs, whose first use imports torch._dynamo: ~2.5 CPU-s a process."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextmanager
def on_meta():
    """Modules built here are on the meta device, their parameters unfilled."""
    with torch.device("meta"), _SkipInit():
        yield


def mtp_tensor(name: str, args: ModelArgs | V4Args) -> bool:
    """A tensor of the multi-token-prediction layers (DeepSeek-V3's numbered after the model's own, DeepSeek-V4's
    under ``mtp.``): greedy decoding runs without them (as transformers' causal LMs), so they are not read."""
    if args.model_type == V4:
        return _V4_MTP.search(name) is not None
    m = _LAYER.match(name)
    return args.num_mtp_layers > 0 and m is not None and int(m.group(1)) >= args.num_hidden_layers


def _shard_map(ckpt_dir: str) -> dict[str, list[str] | None]:
    """{file path: tensor names the index promises (None for a single unindexed file)}."""
    index = os.path.join(ckpt_dir, INDEX)
    single = os.path.join(ckpt_dir, SINGLE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: cannot read safetensors index ({e!r})") from e
        files: dict[str, list[str] | None] = {}
        for name, fname in weight_map.items():
            files.setdefault(os.path.join(ckpt_dir, fname), []).append(name)
        for path in files:
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: safetensors shard listed in {index} not found")
        return files
    if os.path.isfile(single):
        return {single: None}
    raise CheckpointError(f"{ckpt_dir}: no {SINGLE} or {INDEX} found")


def read_tensors(ckpt_dir: str, skip: Callable[[str], bool] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a checkpoint directory -> ({HF name: tensor}, {HF name: file}).

    Names for which ``skip(name)`` is true are not read: they come back as ``meta`` tensors of the stored
    shape and dtype, so they can still be checked by name, shape and dtype.
    """
    tensors, where = {}, {}
    for path, promised in _shard_map(os.fspath(ckpt_dir)).items():
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                names = list(f.keys())
                for name in promised or []:
                    if name not in names:
                        raise CheckpointError(f"{path}: tensor {name!r} listed in the index is missing from the file")
                for name in names:
                    if name in where:
                        raise CheckpointError(f"{path}: tensor {name!r} also present in {where[name]}")
                    tensors[name] = _meta(f, name) if skip and skip(name) else f.get_tensor(name)
                    where[name] = path
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises SafetensorError / OSError / ValueError on corrupt files
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({e})") from e
    return tensors, where


def _meta(f, name: str) -> torch.Tensor:
    sl = f.get_slice(name)
    return torch.empty(sl.get_shape(), dtype=_ST_DTYPES.get(sl.get_dtype(), torch.uint8), device="meta")


def seated(model, sd: dict, args):
    """The model built on the meta device with the checkpoint's tensors as its own, tied, frozen, in eval mode."""
    model.load_state_dict(sd, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()
