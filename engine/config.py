"""Model shapes read from a Hugging Face ``config.json``: the DeepSeek MLA family (DeepSeek-V2, DeepSeek-V3;
``ModelArgs``) and DeepSeek-V4 (``V4Args``). ``load_args`` / ``args_from_hf`` pick the class by ``model_type``.

``ModelArgs``' field names and defaults follow ``transformers.DeepseekV2Config``; a ``deepseek_v3`` config brings its
own routing (``noaux_tc``: sigmoid scores, a correction bias for the choice, group top-k) and ``rope_interleave``.
``V4Args`` follows ``transformers.DeepseekV4Config``, its defaults (DeepSeek-V4-Flash) and its ``__post_init__``
(per-layer attention and MLP types, compression rates, the two ropes).
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
V4 = "deepseek_v4"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or does not match the model; the message names the file/tensor."""


def yarn_factor(rp: dict, max_position: int) -> float:
    """A yarn rope dict's ``factor``; when null, max_position_embeddings / original_max_position_embeddings (as HF)."""
    if rp.get("factor") is not None:
        return rp["factor"]
    return max_position / rp["original_max_position_embeddings"]


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
        return yarn_factor(self.rope_parameters, self.max_position_embeddings)

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
                                      f"{', '.join((*ROUTINGS, V4))}): its config is not read as another model's")
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
        return cls.from_hf(read_config(path))


def read_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` dict of a checkpoint directory (or a config.json path)."""
    path = os.fspath(path)
    cfg = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise CheckpointError(f"{cfg}: config.json not found")
    try:
        with open(cfg) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg}: cannot read config ({e})") from e


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4
# ---------------------------------------------------------------------------------------------
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
MLP_TYPES = (HASH_MOE, MOE)
# transformers' DeepseekV4Config defaults, where a config leaves a field out
DEFAULT_RATES = {CSA: 4, HCA: 128}  # tokens per compressed entry
DEFAULT_HASH_LAYERS = 3  # the first layers' MLPs are hash-routed
DEFAULT_PARTIAL_ROTARY = 64 / 512  # qk_rope_head_dim over head_dim
_RATIO_TYPE = {0: SLIDING, **{r: t for t, r in DEFAULT_RATES.items()}}  # the legacy per-layer compress_ratios
SCORING = ("sqrtsoftplus", "sigmoid")
# V4Args fields a config may leave null: derived (schedules, rates, ropes) or truly optional (token ids)
V4_OPTIONAL = {"layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor", "rope_parameters",
               "pad_token_id", "bos_token_id", "eos_token_id"}


@dataclass
class V4Args:
    """DeepSeek-V4's shape: transformers' DeepseekV4Config fields, defaults and derived layer schedules."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_types: list | None = None
    compress_rates: dict | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    mlp_layer_types: list | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-6
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    partial_rotary_factor: float | None = None
    # {"main": rope of the sliding layers, "compress": rope of the CSA/HCA layers and their compressors}, each in
    # ModelArgs' standardised form (yarn, when given, on "compress" only, as transformers)
    rope_parameters: dict | None = None
    model_type: str = V4

    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers or 0

    def ratio(self, layer: int) -> int:
        """Source tokens a compressed entry of ``layer`` covers (0: a sliding-only layer)."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else self.compress_rates[t]

    def validate(self) -> None:
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries for num_hidden_layers={n}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name}: {bad} not among {list(allowed)}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.mlp_bias or self.attention_bias:
            raise NotImplementedError("mlp_bias / attention_bias: DeepSeek-V4's projections have no biases here")
        if self.scoring_func not in SCORING:
            raise NotImplementedError(f"scoring_func={self.scoring_func!r} is not supported (supported: "
                                      f"{', '.join(SCORING)})")
        if not self.norm_topk_prob:
            raise NotImplementedError("norm_topk_prob=false: transformers' DeepSeek-V4 routers always renormalise")
        if self.num_key_value_heads != 1:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads}: DeepSeek-V4 has one shared KV head")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} must divide num_attention_heads={self.num_attention_heads}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts="
                             f"{self.n_routed_experts}")
        rope = self.qk_rope_head_dim
        if rope % 2 or not 0 < rope <= self.head_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives {rope} rope dims of "
                             f"head_dim={self.head_dim}: they must be even and at most head_dim")
        if self.index_head_dim < rope:
            raise ValueError(f"index_head_dim={self.index_head_dim} is under the {rope} rope dims")
        for t in (CSA, HCA):
            if t in self.layer_types and not (isinstance(self.compress_rates.get(t), int) and self.compress_rates[t] >= 1):
                raise ValueError(f"compress_rates.{t} must be a positive integer, got {self.compress_rates.get(t)!r}")
        if self.sliding_window < 1 or self.index_topk < 1 or self.hc_sinkhorn_iters < 1 or self.hc_mult < 1:
            raise ValueError("sliding_window, index_topk, hc_sinkhorn_iters and hc_mult must be >= 1")
        if not self.swiglu_limit > 0:  # 0 would zero every expert (transformers too); the kernels read 0 as no clamp
            raise ValueError(f"swiglu_limit={self.swiglu_limit} must be > 0")
        if self.n_shared_experts != 1:
            raise NotImplementedError(f"n_shared_experts={self.n_shared_experts}: DeepSeek-V4 has one shared expert "
                                      "(transformers' ignores the field)")
        for kind, rp in self.rope_parameters.items():
            if rp["rope_type"] not in SUPPORTED_ROPE_TYPES:
                raise NotImplementedError(f"rope_parameters.{kind}.rope_type={rp['rope_type']!r} is not supported "
                                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            if rp["rope_type"] == "yarn" and not rp.get("original_max_position_embeddings"):
                raise ValueError(f"rope_parameters.{kind}.original_max_position_embeddings is required for yarn rope")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "V4Args":
        """As DeepseekV4Config.__post_init__: the legacy keys folded in, the schedules and ropes filled in."""
        names = {f.name for f in dataclasses.fields(cls)}
        nulls = sorted(k for k in names - V4_OPTIONAL - {"model_type"} if k in d and d[k] is None)
        if nulls:  # transformers' strict config refuses them too: a null is not its default
            raise ValueError(f"DeepSeek-V4 config fields may not be null: {', '.join(nulls)}")
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        a = cls(**{**kw, "model_type": V4})
        n = a.num_hidden_layers
        rates = dict(a.compress_rates or DEFAULT_RATES)
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = d["compress_rate_csa"]
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = d["compress_rate_hca"]
        a.compress_rates = rates
        if a.layer_types is None and d.get("compress_ratios") is not None:
            a.layer_types = [_RATIO_TYPE.get(r, r) for r in d["compress_ratios"]]
        if a.layer_types is None:  # V4-Pro's default: two HCA layers, then CSA and HCA in turn
            a.layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        a.layer_types = list(a.layer_types[:n])
        if a.mlp_layer_types is None:
            n_hash = d.get("num_hash_layers")
            n_hash = DEFAULT_HASH_LAYERS if n_hash is None else n_hash
            a.mlp_layer_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        a.mlp_layer_types = list(a.mlp_layer_types[:n])
        if a.partial_rotary_factor is None:
            a.partial_rotary_factor = (d["qk_rope_head_dim"] / a.head_dim if d.get("qk_rope_head_dim") is not None
                                       else DEFAULT_PARTIAL_ROTARY)
        a.rope_parameters = _v4_ropes(d, a)
        a.validate()
        return a


def _v4_ropes(d: dict, a: V4Args) -> dict:
    """{"main", "compress"}: the main rope plain (rope_theta), the compressed layers' compress_rope_theta with the
    config's scaling; a yarn compress rope has attention_factor 1 unless it says otherwise (transformers)."""
    rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    if nested:  # as transformers keeps them (what save_pretrained writes)
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": a.rope_theta}
        compress = {k: v for k, v in rp.items() if k not in ("main", "compress", "partial_rotary_factor")}
        compress["rope_theta"] = a.compress_rope_theta
    out = {}
    for kind, r in (("main", main), ("compress", compress)):
        r.setdefault("rope_type", r.pop("type", "default"))
        r.pop("type", None)
        r.setdefault("rope_theta", a.rope_theta)
        partial = r.pop("partial_rotary_factor", None)  # V4Args.partial_rotary_factor is the one
        if partial is not None and partial != a.partial_rotary_factor:
            raise NotImplementedError(f"rope_parameters.{kind}.partial_rotary_factor={partial} differs from "
                                      f"partial_rotary_factor={a.partial_rotary_factor}: one rope width is supported")
        if r["rope_type"] == "yarn":
            if not nested:  # transformers: the V4 reference does not scale cos/sin by yarn's mscale
                r.setdefault("attention_factor", 1.0)
            r.setdefault("original_max_position_embeddings", a.max_position_embeddings)
        out[kind] = r
    return out


def args_from_hf(d: dict[str, Any]) -> "ModelArgs | V4Args":
    """The shape of a config.json dict: V4Args for ``deepseek_v4``, else ModelArgs (which refuses what it cannot
    read)."""
    return V4Args.from_hf(d) if d.get("model_type") == V4 else ModelArgs.from_hf(d)


def load_args(path: str | os.PathLike) -> "ModelArgs | V4Args":
    """args_from_hf of a checkpoint directory's config.json."""
    return args_from_hf(read_config(path))
