"""The recipes on the real engines `make engines` installs, through the parity stage and the comparison as a campaign
runs them: each unmodified engine passes, and each defect a user can make through the engine's own flags is caught
(llama.cpp's f16 KV cache, declared and not; vLLM's rope and routing overrides). Float32, the CPU, random weights:
the tiny model for llama.cpp, the tiny model with vLLM's 576-wide MLA latent for vLLM (its CPU MLA takes no other).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import tinyev
import yaml

from evident.workflow.core.evidence import read_json
from evident.workflow.models import gguf
from evident.workflow.plan import recipes
from evident.workflow.plan.campaign import model_config
from evident.workflow.stages import compare, parity_target
from evident.workflow.stages import oracle as oracle_stage

REPO = Path(__file__).resolve().parents[2]
PARITY = {**tinyev.defaults(yaml.safe_load((REPO / "config/schema.yaml").read_text())["properties"]["parity"]),
          "batch_sizes": [1, 2]}
PYTHON = {name: REPO / ".engines" / name / "bin/python" for name in recipes.MADE}
pytestmark = pytest.mark.engines


def installed(env: str):
    return pytest.mark.skipif(not PYTHON[env].is_file(), reason=f"{PYTHON[env]} is missing: run `make engines`")


def campaign(root: Path, base: str) -> tuple[Path, Path, dict, dict]:
    """(checkpoint, evidence dir, config, oracle) of a synthetic float32 campaign on config/models/<base>.yaml."""
    spec = {**tinyev.synthetic(), "config": model_config(base)}
    cfg = tinyev.config(parity=PARITY, checkpoint=spec)
    ckpt, ev = tinyev.make(root, cfg)
    oracle_stage.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    return ckpt, ev, cfg, read_json(ev / "oracle/hf.json")


def entry(cfg: dict, **e) -> dict:
    """The `engines:` entry as the campaign check expands it."""
    full = {"dtype": cfg["dtype"], "checkpoint": cfg["checkpoint"], "engines": [e]}
    recipes.expand(full, cfg["checkpoint"]["config"])
    return full["engines"][0]


def held(shared, spec: dict, batch_sizes=(1, 2)) -> dict:
    ckpt, ev, _, oracle = shared
    parity_target.run(ckpt, ev, spec, list(batch_sizes))
    return compare.compare(oracle, [read_json(ev / f"parity/{spec['name']}-b{b}.json") for b in batch_sizes])


# --- llama.cpp ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    gguf.CACHE = root / "gguf"  # not the working directory's cache
    return campaign(root, "tiny")


def llama_entry(shared, name: str, recipe: str = "llama-cpp", **e) -> dict:
    # one thread: llama.cpp's waiting threads spin, which a busy 2-core machine turns into seconds a case
    threads = ["--threads", "1"] if recipe == "llama-cpp" else ["--n_threads", "1"]
    return entry(shared[2], name=name, recipe=recipe, python=str(PYTHON["llama-cpp"]),
                 **{**e, "args": [*threads, *e.get("args", [])]})


@installed("llama-cpp")
def test_llama_cpp_is_token_exact_with_the_logic_check_and_records_what_ran(llama):
    result = held(llama, llama_entry(llama, "llama-cpp"))
    t = result["targets"]["llama-cpp"]
    assert (result["verdict"], t["level"], t["not_checked"].get("logic")) == ("all_token_text_exact", "token", None)
    assert max(f["logic"]["max"] for f in result["forced"]) < PARITY["logic_tolerance"]
    run = read_json(llama[1] / "parity/llama-cpp-b1.json")["target"]
    assert run["recipe"] == "llama-cpp" and run["version"] and run["kv_cache_dtype"] == "float32"
    assert len(run["converted"]["sha256"]) == 64 and run["converted"]["outtype"] == "f32"


@installed("llama-cpp")
def test_llama_cpps_f16_kv_cache_is_caught_and_named_for_what_it_is(llama):
    declared = held(llama, llama_entry(llama, "llama-f16", kv_cache_dtype="float16"), (1,))
    assert declared["verdict"] == "kv_cache_precision_gap"
    assert {c["free_running"] for c in declared["cells"]} <= {"all_token_text_exact", "near_tie_divergence",
                                                               "engine_accuracy_gap"}
    # the same cache through a raw flag, the entry claiming float32: a misconfigured engine, wrong as declared
    hidden = held(llama, llama_entry(llama, "llama-f16-flag", args=["--kv-type", "f16"]), (1,))
    assert hidden["verdict"] == "engine_accuracy_gap"
    print(f"llama.cpp f16 KV cache: logic max |Δ| {max(f['logic']['max'] for f in declared['forced']):.3g}")


@installed("llama-cpp")
def test_llama_cpps_server_answers_ids_with_500_and_is_held_at_text_level(llama):
    spec = llama_entry(llama, "llama-server", recipe="llama-cpp-server")
    result = held(llama, spec, (1,))
    t = result["targets"]["llama-server"]
    assert t["level"] == "text" and set(t["not_checked"]) == {"logic", "precision"}
    assert read_json(llama[1] / "parity/llama-server-b1.json")["target"]["offers"]["dialect"] == "text"
    # probed as an unknown OpenAI server is (point 2): its 500 to a prompt of ids is recorded, not fatal
    held(llama, {**spec, "name": "llama-probed", "dialect": "openai"}, (1,))
    offers = read_json(llama[1] / "parity/llama-probed-b1.json")["target"]["offers"]
    assert not offers["token_prompt"] and offers["refused"][0].startswith("500")
    # random weights: its text parts from the oracle's where bytes are not UTF-8 alone (point 12), and says so
    d = result["first_divergence"]
    assert t["verdict"] == "text_only" or d["hint"] == compare.UNDECODABLE_HINT, d


# --- vLLM -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    return campaign(tmp_path_factory.mktemp("vllm"), "tiny-mla576")


def vllm_entry(shared, name: str, **e) -> dict:
    return entry(shared[2], name=name, recipe="vllm", python=str(PYTHON["vllm"]), **e)


@installed("vllm")
def test_vllm_is_token_exact_with_the_logic_check_and_no_path_in_its_record(vllm):
    result = held(vllm, vllm_entry(vllm, "vllm"))
    t = result["targets"]["vllm"]
    assert (result["verdict"], t["level"], t["not_checked"].get("logic")) == ("all_token_text_exact", "token", None)
    run = read_json(vllm[1] / "parity/vllm-b2.json")["target"]
    assert run["model"] == "vllm" and run["offers"]["echo"] and run["version"]
    assert str(Path.home()) not in json.dumps(run) and str(REPO) not in json.dumps(run)
    print(f"vLLM: logic max |Δ| {max(f['logic']['max'] for f in result['forced']):.3g}")


# vLLM's config is transformers 5's: a top-level rope_theta override leaves its rope_parameters, which the model reads,
# as they were (seen: exact); the rope is overridden through rope_parameters
ROPE = {"rope_parameters": {**model_config("tiny-mla576")["rope_scaling"], "rope_type": "yarn", "rope_theta": 20000}}


@installed("vllm")
@pytest.mark.parametrize("defect", [ROPE, {"num_experts_per_tok": 1}], ids=["rope", "routing"])
def test_a_wrong_override_through_vllms_own_flag_is_caught(vllm, defect):
    overrides = json.dumps({"n_group": 1, "topk_group": 1, **defect})  # the last --hf-overrides is the one vLLM takes
    result = held(vllm, vllm_entry(vllm, f"vllm-{next(iter(defect)).replace('_', '-')}",
                                   args=["--hf-overrides", overrides]), (1,))
    assert result["verdict"] == "engine_accuracy_gap", result["first_divergence"]
    print(f"vLLM {next(iter(defect))} override: logic max |Δ| {max(f['logic']['max'] for f in result['forced']):.3g}")


@installed("vllm")
def test_two_vllm_entries_are_a_variant_pair(vllm):
    eager = copy.deepcopy(read_json(vllm[1] / "parity/vllm-b1.json"))  # from the exact run above
    held(vllm, vllm_entry(vllm, "vllm-eager", args=["--enforce-eager"]), (1,))
    twin = read_json(vllm[1] / "parity/vllm-eager-b1.json")
    result = compare.compare(vllm[3], [eager, twin], pairs=[("vllm", "vllm-eager")])
    assert result["pairs"][0]["verdict"] == "all_token_text_exact"


@pytest.fixture(scope="module")
def vllm_bf16(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-bf16")
    spec = {**tinyev.synthetic(), "config": model_config("tiny-mla576")}
    cfg = tinyev.config(parity={**PARITY, "batch_sizes": [1]}, checkpoint=spec, dtype="bfloat16")
    ckpt, ev = tinyev.make(root, cfg)
    oracle_stage.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    return ckpt, ev, cfg, read_json(ev / "oracle/hf.json")


@installed("vllm")
def test_in_a_bf16_campaign_vllm_passes_the_precision_check_and_its_routing_defect_fails_it(vllm_bf16):
    """bf16 hides a logic bug under rounding: the forced run's error over transformers' own bf16 error names it."""
    good = held(vllm_bf16, vllm_entry(vllm_bf16, "vllm-bf16"), (1,))
    assert good["verdict"] == "all_token_text_exact" and good["forced"][0]["precision"]["pass"]
    overrides = json.dumps({"n_group": 1, "topk_group": 1, "num_experts_per_tok": 1})
    bad = held(vllm_bf16, vllm_entry(vllm_bf16, "vllm-bf16-routing", args=["--hf-overrides", overrides]), (1,))
    assert bad["verdict"] == "precision_regression" and not bad["forced"][0]["precision"]["pass"]
    print(f"vLLM bf16: precision ratio {good['forced'][0]['precision']['ratio']:.3f}; routing override "
          f"{bad['forced'][0]['precision']['ratio']:.3f} (bound {bad['precision_bound']})")
