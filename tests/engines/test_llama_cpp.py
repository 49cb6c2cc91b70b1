"""llama.cpp (`make engines`: llama-cpp-python and its own HF-to-GGUF converter) as a token-level `command` target
on the default campaign's tiny model (random weights, float32): the conversion and its cache (workflow/models/gguf.py), the
adapter's trace (workflow/adapters/llama_cpp.py) through the command runner, held to transformers' own
DeepseekV2ForCausalLM as the oracle stage runs it, and the converter shim's tokenizer check.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import tinyev
import yaml

from evident.workflow.models import checkpoints, gguf
from evident.workflow.plan import targets

REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / ".engines/llama-cpp"
PYTHON, CONVERTER = LLAMA / "bin/python", LLAMA / "convert"
ADAPTERS = REPO / "workflow/adapters"
pytestmark = [pytest.mark.engines, pytest.mark.skipif(
    not PYTHON.is_file() or not (CONVERTER / gguf.SCRIPT).is_file(),
    reason=f"llama.cpp is not installed ({PYTHON} and {CONVERTER}/{gguf.SCRIPT}): run `make engines`")]
# 3 layers and no q_lora_rank: llama.cpp's deepseek2 loader reads q_lora_rank unless a model has V2-Lite's 27 layers
OVERRIDE = "--kv-override deepseek2.attention.q_lora_rank=int:0"
TOLERANCE = 1e-3  # max |Δ log-prob| against the float32 oracle, KV cache in float32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    spec = tinyev.synthetic()
    return checkpoints.write_synthetic(tmp_path_factory.mktemp("ckpt") / "tiny", spec["config"], spec["seed"],
                                       spec["init_std"], "float32")


@pytest.fixture(scope="module")
def converted(ckpt, tmp_path_factory) -> tuple[dict, Path]:
    cache = tmp_path_factory.mktemp("gguf")
    return gguf.convert(ckpt, str(PYTHON), CONVERTER, "f32", cache, cache / "convert.log"), cache


@pytest.fixture(scope="module")
def oracle(ckpt) -> tuple[dict, dict]:
    """(request, oracle cases): the default campaign's cases through the oracle stage's own code, batch 2."""
    import torch

    from evident.engine.checkpoint import eos_ids
    from evident.workflow.models import hf
    from evident.workflow.parity import logprobs
    from evident.workflow.stages.oracle import path_logits, run_case

    cases = yaml.safe_load((REPO / "config/config.yaml").read_text())["cases"]
    tok, model = hf.load(ckpt, "float32", "cpu")
    with torch.inference_mode():
        out = {c["name"]: run_case(tok, model, c, "cpu") for c in cases}
        for o in out.values():
            o["reference"] = logprobs.reference(path_logits(model, o["prompt_ids"] + o["generated_ids"], "cpu"), 8)
    request = {"schema": "evident-request/1", "batch": 2, "top_k": 8, "eos_token_ids": eos_ids(ckpt),
               "cases": [{"name": c["name"], "prompt_ids": out[c["name"]]["prompt_ids"],
                          "max_new_tokens": c["max_new_tokens"], "forced_ids": out[c["name"]]["generated_ids"],
                          "score_ids": out[c["name"]]["reference"]["top_ids"]} for c in cases]}
    return request, out


@pytest.fixture(scope="module")
def traces(converted, oracle, tmp_path_factory) -> dict[str, dict]:
    """The adapter's trace with its KV cache in f32 and in f16, through the pipeline's command runner."""
    (conv, _), (request, _) = converted, oracle
    work = tmp_path_factory.mktemp("llama")
    out = {}
    for kv in ("f32", "f16"):
        # one thread: llama.cpp's threads spin while they wait, which a busy 2-core machine turns into seconds
        q = lambda path: shlex.quote(str(path))  # noqa: E731
        spec = {"name": f"llama-cpp-{kv}",
                "command": f"{q(PYTHON)} {q(ADAPTERS / 'llama_cpp.py')} --model {q(conv['path'])} "
                           f"--request {{request}} --out {{out}} --kv-type {kv} --threads 1 {OVERRIDE}"}
        out[kv] = targets.run_command(spec, request, work / kv, work / f"{kv}.log")
    return out


def max_error(trace: dict, oracle: dict) -> float:
    return max(abs(a - b) for case in trace["cases"] for row in case["forced_rows"]
               for want, got in zip(oracle[case["name"]]["reference"]["top_logprobs"], row["score_logprobs"])
               for a, b in zip(want, got))


def test_conversion_is_cached_by_content(ckpt, converted):
    first, cache = converted
    assert not first["cached"] and first["path"].is_file() and first["outtype"] == "f32"
    assert first["converter"].startswith("llama.cpp convert_hf_to_gguf.py (")
    again = gguf.convert(ckpt, str(PYTHON), CONVERTER, "f32", cache, cache / "convert.log")
    assert again["cached"] and again["sha256"] == first["sha256"] and again["path"] == first["path"]
    half = gguf.convert(ckpt, str(PYTHON), CONVERTER, "f16", cache, cache / "convert.log")
    assert not half["cached"] and half["path"] != first["path"] and half["sha256"] != first["sha256"]
    assert not list(cache.glob("*/.*.part")), "a temporary file left behind"
    with pytest.raises(gguf.ConvertError, match="make engines"):
        gguf.convert(ckpt, str(PYTHON), cache / "no-converter", "f32", cache, cache / "convert.log")


def test_f32_kv_matches_transformers(traces, oracle):
    request, want = oracle
    trace = targets.check_trace(traces["f32"], request, "llama.cpp f32")
    assert trace["engine"].startswith("llama.cpp via llama-cpp-python ")
    for case in trace["cases"]:
        assert [r["generated_ids"] for r in case["rows"]] == [want[case["name"]]["generated_ids"]] * request["batch"]
    err = max_error(trace, want)
    print(f"llama.cpp, KV cache f32: max |Δ log-prob| {err:.3g} against transformers float32")
    assert err < TOLERANCE


def test_f16_kv_error_is_seen(traces, oracle):
    """A KV cache in f16 is a real loss of precision: the forced error the gate reads must show it."""
    request, want = oracle
    targets.check_trace(traces["f16"], request, "llama.cpp f16")
    f32, f16 = max_error(traces["f32"], want), max_error(traces["f16"], want)
    print(f"llama.cpp max |Δ log-prob| against transformers float32: KV cache f32 {f32:.3g}, f16 {f16:.3g}")
    assert f16 > f32


def test_shim_labels_only_a_plain_byte_level_tokenizer(ckpt):
    spec = importlib.util.spec_from_file_location("gguf_convert", ADAPTERS / "gguf_convert.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    assert shim.plain_byte_level(ckpt / "tokenizer.json")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    others = {
        "prefix space": {"pre_tokenizer": {**byte_level, "add_prefix_space": True}},
        "no regex split": {"pre_tokenizer": {**byte_level, "use_regex": False}},
        "a sequence": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\d{1,3}"}, "behavior": "Isolated", "invert": False}, byte_level]}},
        "metaspace": {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}},
        "a normalizer": {"normalizer": {"type": "NFC"}},
        "no pre-tokenizer": {"pre_tokenizer": None},
    }
    for why, change in others.items():
        path = ckpt.parent / f"tokenizer-{why.replace(' ', '-')}.json"
        path.write_text(json.dumps({**copy.deepcopy(tok), **change}))
        assert not shim.plain_byte_level(path), why
    assert not shim.plain_byte_level(ckpt.parent / "missing.json")
