"""Model shape of the DeepSeek MLA family (DeepSeek-V2, DeepSeek-V3), read from a Hugging Face ``config.json``.

Field names and defaults follow ``transformers.DeepseekV2Config``; a ``deepseek_v3`` config brings its own routing
(``noaux_tc``: sigmoid scores, a correction bias for the choice, group top-k) and ``rope_interleave``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "yarn")
# DeepSeek-V3 fields whose null in a config.json means their default
NOT_NULL = {"model_type", "rope_interleave", "num_mtp_layers"}
# model_type -> the routings (topk_method) it defines, its own first: a config is never read as another family
ROUTINGS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class ModelArgs:
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # rope: always the standardised form {"rope_type": ..., "rope_theta": ..., yarn keys...}
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    # MLA
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # MoE
    first_k_dense_replace: int = 0
    n_routed_experts: int = 64
    n_shared_experts: int | None = 2
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int = 1407
    routed_scaling_factor: float = 1.0
    topk_method: str | None = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool | None = False
    # the family, and what DeepSeek-V3 adds
    model_type: str = "deepseek_v2"
    rope_interleave: bool = True  # rope on adjacent pairs (x0, x1), as V2; false: on the halves (x_i, x_i+D/2)
    num_mtp_layers: int = 0  # multi-token-prediction layers a V3 checkpoint may hold: not part of the model run here

    @property
    def routing(self) -> str:
        """greedy, group_limited_greedy (V2) or noaux_tc (V3, whose transformers config has no topk_method)."""
        return "noaux_tc" if self.model_type == "deepseek_v3" else (self.topk_method or "greedy")

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @property
    def rope_factor(self) -> float:
        """yarn ``factor``; when null, max_position_embeddings / original_max_position_embeddings (as HF)."""
        rp = self.rope_parameters
        if rp.get("factor") is not None:
            return rp["factor"]
        return self.max_position_embeddings / rp["original_max_position_embeddings"]

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 for scaled rope (HF yarn_apply_mscale)."""
        scale = self.qk_head_dim ** (-0.5)
        rp = self.rope_parameters
        if self.rope_type != "default" and rp.get("mscale_all_dim", 0):
            m = yarn_get_mscale(self.rope_factor, rp["mscale_all_dim"])
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        if self.model_type not in ROUTINGS:
            raise NotImplementedError(f"model_type={self.model_type!r} is not supported (supported: "
                                      f"{', '.join(ROUTINGS)}): its config is not read as another model's")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                f"{self.num_attention_heads} (MLA expands K/V to every head)")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(
                f"rope_type={self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if self.rope_type == "yarn" and not self.rope_parameters.get("original_max_position_embeddings"):
            raise ValueError("rope_parameters.original_max_position_embeddings is required for yarn rope")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            if not self.num_experts_per_tok:
                raise ValueError(
                    "num_experts_per_tok must be set (>= 1) when the model has MoE layers "
                    f"(first_k_dense_replace={self.first_k_dense_replace} < num_hidden_layers={self.num_hidden_layers})")
            if not self.n_routed_experts or self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be <= n_routed_experts={self.n_routed_experts}")
            self._validate_routing()

    def _validate_routing(self) -> None:
        if self.model_type == "deepseek_v3" and self.topk_method not in (None, "greedy", "noaux_tc"):
            # V3's own configs say noaux_tc (or nothing, as transformers writes them); greedy is V2's default here
            raise NotImplementedError(f"topk_method={self.topk_method!r} with model_type deepseek_v3: only "
                                      "noaux_tc (sigmoid scores, correction bias, group top-k) is DeepSeek-V3's")
        if self.routing not in ROUTINGS[self.model_type]:
            raise NotImplementedError(f"topk_method={self.topk_method!r} is not supported for {self.model_type} "
                                      f"(supported: {', '.join(ROUTINGS[self.model_type])})")
        if self.routing == "greedy":
            return
        e, g, t = self.n_routed_experts, self.n_group, self.topk_group
        if not g or not t or e % g or t > g:
            raise ValueError(f"{self.routing}: n_group={g} must divide n_routed_experts={e} and topk_group={t} "
                             f"must be in 1..n_group")
        if self.routing == "noaux_tc" and e // g < 2:
            raise ValueError(f"noaux_tc ranks groups by their top-2 scores: n_group={g} leaves {e // g} expert(s) a group")
        if self.num_experts_per_tok > t * (e // g):
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} > the {t * (e // g)} experts of "
                             f"topk_group={t} groups")

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelArgs":
        """Build from an HF config.json dict. Unknown keys are ignored.

        RoPE may come as the transformers-5 ``rope_parameters`` dict or as the legacy
        ``rope_theta`` + ``rope_scaling: {type: yarn, ...}``; both are standardised like
        HF ``standardize_rope_params``.
        """
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_parameters"}
        kwargs = {k: v for k, v in d.items() if k in names and not (v is None and k in NOT_NULL)}
        if d.get("num_nextn_predict_layers") is not None:  # DeepSeek's own name for V3's MTP layers
            kwargs.setdefault("num_mtp_layers", d["num_nextn_predict_layers"])
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rp = dict(rp)
        rp.setdefault("rope_type", rp.get("type", "default"))
        rp.pop("type", None)
        rp.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        if rp["rope_type"] == "yarn":
            if d.get("original_max_position_embeddings") is not None:  # top-level value wins, as in HF
                rp["original_max_position_embeddings"] = d["original_max_position_embeddings"]
            rp.setdefault("original_max_position_embeddings",
                          d.get("max_position_embeddings", cls.max_position_embeddings))
        kwargs["rope_parameters"] = rp
        args = cls(**kwargs)
        args.validate()
        return args

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelArgs":
        """Read ``config.json`` from a checkpoint directory (or a config.json path)."""
        from .checkpoint import CheckpointError  # lazy: checkpoint imports this module

        path = os.fspath(path)
        cfg = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            raise CheckpointError(f"{cfg}: config.json not found")
        try:
            with open(cfg) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg}: cannot read config ({e})") from e
        return cls.from_hf(d)
