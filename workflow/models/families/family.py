"""The record a model family fills (`Family`): what the workflow asks of a model."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from evident.engine.config import read_config

# A config naming no model_type is DeepSeek-V2's, as engine.config.ModelArgs reads it.
DEFAULT_MODEL_TYPE = "deepseek_v2"
# transformers' config fields no family's engine reader needs, and the legacy rope keys the readers fold in
HF_ONLY = frozenset({"architectures", "model_type", "torch_dtype", "dtype", "initializer_range", "use_cache",
                     "pretraining_tp", "attention_dropout", "output_router_logits", "head_dim", "qk_head_dim",
                     "rope_theta", "rope_scaling", "transformers_version"})


class UnknownFamily(ValueError):
    """A config's model_type is no family's: the message names it and the known ones."""


@dataclass(frozen=True, eq=False)  # a family is one object: compared and hashed by identity
class Family:
    """What the workflow asks of a model family. `args` is the engine's reading of a config.json dict; the
    functions below that take `args` take that reading."""
    name: str  # for messages: "DeepSeek-V2/V3"
    architectures: Mapping[str, str]  # model_type -> transformers' class (its config class: Config for ForCausalLM)
    args: Callable[[dict], Any]  # the engine's reading of a config.json dict (its checks included)
    tiny: str  # config/models/<tiny>.yaml: the fields a complete checkpoint.config states
    keys: frozenset  # the fields a campaign's checkpoint.config may state
    problems: Callable[[dict], list]  # (key, message) for what the engine cannot run of a resolved campaign
    parameters: Callable[[Any], int]  # transformers' model's parameters and checkpoint buffers: the size estimate
    saved_state: Callable[[Any, bool], dict]  # (transformers model, tied) -> its tensors under the checkpoint's names
    pads_values: bool  # transformers' CPU sdpa needs its values zero-padded (query and value head sizes differ)
    mtp_skip: str  # why the checkpoint record skips the multi-token-prediction tensors
    audit: Callable[[Any], dict]  # kernel audit: k, vocab, experts, options (kernels.audit.audit's), not_covered
    layout: Callable[[Any, Any], dict]  # (args, torch dtype) -> bench.floor.Layout's fields
    overlap_fields: Callable[[dict], dict | None]  # the overlap screen's projections' fields, None: nothing screened
    # (checkpoint dir, config, torch dtype) -> (record, weights) of the layer the overlap screen runs with its own
    # weights; None: the screen needs no checkpoint
    own_layer: Callable[[Any, dict, Any], tuple] | None

    def load(self, ckpt_dir: str | os.PathLike):
        """The engine's reading of a checkpoint directory's config.json."""
        return self.args(read_config(ckpt_dir))
