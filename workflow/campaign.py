"""Campaign config validation with a short error that names the offending key."""

from __future__ import annotations

import copy
import dataclasses
import os

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from engine.config import ModelArgs
from workflow.evidence import sha256_bytes

# HF DeepseekV2Config fields the engine does not need, and the legacy rope keys it reads.
HF_ONLY = {"architectures", "model_type", "torch_dtype", "dtype", "initializer_range", "use_cache",
           "pretraining_tp", "attention_dropout", "output_router_logits", "head_dim", "qk_head_dim",
           "rope_theta", "rope_scaling", "transformers_version"}
MODEL_KEYS = {f.name for f in dataclasses.fields(ModelArgs)} | HF_ONLY


def fail(where: str, message: str) -> None:
    raise WorkflowError(f"invalid campaign config at `{where}`: {message}. "
                        f"See config/schema.yaml and the README's key table.")


def validate_campaign(config: dict, schema: str) -> None:
    """Validate and fill defaults (snakemake.utils.validate); re-raise naming the key and value.

    `checkpoint.config` is checked against the DeepSeek-V2 config fields too: transformers would
    accept a misspelt field silently and build its default (a 32-layer model) instead.
    """
    try:
        validate(config, schema, set_default=True)
    except WorkflowError as e:
        cause = e.__context__  # the jsonschema ValidationError that snakemake wrapped
        if not hasattr(cause, "absolute_path"):
            raise
        fail(".".join(str(p) for p in cause.absolute_path) or "<top level>", cause.message)
    unknown = sorted(set(config["checkpoint"].get("config", {})) - MODEL_KEYS)
    if unknown:
        fail("checkpoint.config", f"unknown DeepSeek-V2 config field(s) {', '.join(map(repr, unknown))}")


def _redact_path(value: str) -> str:
    """A path becomes its last part plus a hash of the whole: distinct, yet no home or user name."""
    return f"<path>/{os.path.basename(os.path.normpath(value))}#{sha256_bytes(value.encode())[:8]}"


def evidence_config(config: dict) -> dict:
    """The config as recorded in evidence and hashed into the id.

    `tracking` is left out (where runs are logged is not part of what was measured, and a URL may
    carry a host or credentials); file system paths are redacted.
    """
    out = copy.deepcopy({k: v for k, v in config.items() if k != "tracking"})
    if out["checkpoint"].get("path"):
        out["checkpoint"]["path"] = _redact_path(out["checkpoint"]["path"])
    baseline = out.get("bench", {}).get("baseline")
    if baseline and ("/" in baseline or os.sep in baseline):
        out["bench"]["baseline"] = _redact_path(baseline)
    return out
