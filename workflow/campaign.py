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
    check_inputs(config)


def _strings(node, where: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k, where or "<top level>")
            yield from _strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{where}.{i}")
    elif isinstance(node, str):
        yield where, node


def check_inputs(config: dict) -> None:
    """What the schema cannot say, checked before any work (tests/reliability/test_bad_input.py).

    Text must be valid UTF-8 (YAML's `\\udc80` escape gives a lone surrogate that no file can hold),
    prompts must not be blank, a case cannot ask for more tokens than the model's context holds, and
    `device: cuda` needs a GPU here (set EVIDENT_SKIP_DEVICE_CHECK=1 on a submit host without one, whose
    jobs run elsewhere). A prompt's length in tokens needs the tokenizer: the checkpoint record checks it.
    """
    for where, text in _strings(config):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            fail(where, f"not valid UTF-8 text ({e.reason} at character {e.start})")
    for i, case in enumerate(config["cases"]):
        if not case["prompt"].strip():
            fail(f"cases.{i}.prompt", "the prompt is blank")
    if not config["bench"]["prompt"].strip():
        fail("bench.prompt", "the prompt is blank")
    context = config["checkpoint"].get("config", {}).get("max_position_embeddings")
    if isinstance(context, int):
        for i, case in enumerate(config["cases"]):
            if case["max_new_tokens"] >= context:
                fail(f"cases.{i}.max_new_tokens", f"{case['max_new_tokens']} new tokens do not fit the model's "
                     f"context of {context} (checkpoint.config.max_position_embeddings) beside a prompt")
    if config["device"] == "cuda" and not os.environ.get("EVIDENT_SKIP_DEVICE_CHECK"):
        import torch  # only a cuda campaign pays for the import

        if not torch.cuda.is_available():
            fail("device", "cuda was requested but no CUDA GPU is visible here; use device: cpu or auto")


class CampaignFileError(ValueError):
    pass


def read_campaign_file(path: str) -> dict:
    """A campaign file as YAML, or an error naming the file, the line and the fix.

    Snakemake reads `--configfile` itself, before the Snakefile, and answers a bad byte with a traceback;
    `evident run` calls this first so the user reads one line instead.
    """
    import yaml

    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise CampaignFileError(f"campaign file {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CampaignFileError(f"campaign file {path} is not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, "
                                f"column {column}; save it as UTF-8") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise CampaignFileError(f"campaign file {path} is not valid YAML: {getattr(e, 'problem', None) or e}{where}") from None
    if not isinstance(config, dict):
        raise CampaignFileError(f"campaign file {path} must hold a mapping of keys (campaign:, cases:, ...), "
                                f"not {type(config).__name__}")
    return config


def _redact_path(value: str) -> str:
    """A path becomes its last part plus a hash of the whole: distinct, yet no home or user name."""
    return f"<path>/{os.path.basename(os.path.normpath(value))}#{sha256_bytes(value.encode())[:8]}"


def evidence_config(config: dict) -> dict:
    """The config as recorded in evidence and hashed into the id.

    `tracking` and `resources` are left out (where runs are logged and what jobs asked a scheduler for are
    not part of what was measured, and a URL may carry a host or credentials); file system paths are redacted.
    """
    out = copy.deepcopy({k: v for k, v in config.items() if k not in ("tracking", "resources")})
    if out["checkpoint"].get("path"):
        out["checkpoint"]["path"] = _redact_path(out["checkpoint"]["path"])
    baseline = out.get("bench", {}).get("baseline")
    if baseline and ("/" in baseline or os.sep in baseline):
        out["bench"]["baseline"] = _redact_path(baseline)
    gsm = out.get("quality", {}).get("gsm8k", {})
    for split in ("test", "train"):  # data files: the name and a hash of the path; the stage records their sha256
        if gsm.get(split):
            gsm[split] = _redact_path(gsm[split])
    targets = out.get("quality", {}).get("targets", [])
    for t in targets:  # an endpoint URL may carry a host or credentials
        if isinstance(t, dict) and t.get("url"):
            t["url"] = f"<url>#{sha256_bytes(t['url'].encode())[:8]}"
    return out
