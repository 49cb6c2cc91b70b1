"""Recipes (workflow/plan/recipes.py) and the engine-target points they brought: an entry expanded into what the stages
run, refused before any work where its engine is missing; templates whose JSON braces are the command's own and whose
`env` reaches the process; a per-entry readiness limit; a probe's 5xx that falls back to text level; entries kept out
of parity; the served model's id kept out of evidence; a lowered KV cache named as such; variant pairs. The real
engines are held in tests/engines/ (`make test-engines`)."""

from __future__ import annotations

import copy
import http.server
import json
import sys
import threading
from pathlib import Path

import pytest
import tinyev
import yaml
from campaigns import SCHEMA, overridden, rejected
from test_serve_bench import Fake

from evident.workflow.core.evidence import read_json
from evident.workflow.plan import recipes, targets
from evident.workflow.plan.campaign import evidence_config, validate_campaign
from evident.workflow.stages import compare, parity_target

REPO = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((REPO / "config/config.yaml").read_text())
MODEL = yaml.safe_load((REPO / "config/models/tiny.yaml").read_text())


def expanded(*entries, dtype="float32") -> list[dict]:
    cfg = {"dtype": dtype, "checkpoint": {}, "engines": copy.deepcopy(list(entries))}
    recipes.expand(cfg, MODEL)
    return cfg["engines"]


def test_a_recipe_is_one_line_that_expands_to_the_engines_launch_with_a_deepseek_configs_overrides():
    vllm, llama, server = expanded({"name": "vllm", "recipe": "vllm"}, {"name": "llama", "recipe": "llama-cpp"},
                                   {"name": "ls", "recipe": "llama-cpp-server", "args": ["--n_batch", "64"]})
    words = targets.fill(vllm["serve"]["command"], port=1, checkpoint="/c")
    assert words[:3] == [".engines/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    # the JSON reaches vLLM as one word, braces and all (point 8: no doubled braces)
    assert json.loads(words[words.index("--hf-overrides") + 1]) == {"n_group": 1, "topk_group": 1}
    assert words[words.index("--served-model-name") + 1] == "vllm"  # its model id is not the checkpoint's path
    assert vllm["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert vllm["ready_timeout_s"] == 900
    assert (vllm["kind"], vllm["dialect"], vllm["kv_cache_dtype"]) == ("openai", "openai", "float32")
    assert (llama["kind"], llama["weights"]) == ("command", "gguf") and "{gguf}" in llama["command"]
    assert "--kv-type f32 --kv-override deepseek2.attention.q_lora_rank=int:0" in llama["command"]
    assert (server["dialect"], server["weights"]) == ("text", "gguf")
    assert server["serve"]["command"].endswith("--type_k 0 --type_v 0 --kv_overrides "
                                               "deepseek2.attention.q_lora_rank=int:0 --n_batch 64")  # args last
    lowered, = expanded({"name": "llama", "recipe": "llama-cpp", "kv_cache_dtype": "float16"})
    assert "--kv-type f16" in lowered["command"]
    v16, = expanded({"name": "v", "recipe": "vllm", "kv_cache_dtype": "float16"})
    assert "--kv-cache-dtype float16" in v16["serve"]["command"]


def test_the_schemas_recipes_are_the_recipes_written():
    schema = yaml.safe_load((REPO / "config/schema.yaml").read_text())
    assert schema["properties"]["engines"]["items"]["properties"]["recipe"]["enum"] == list(recipes.RECIPES)


def test_a_recipe_whose_engine_is_not_installed_is_refused_naming_make_engines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .engines/ here
    err = rejected(overridden(BASE, engines=[{"name": "vllm", "recipe": "vllm"}]))
    assert "`engines.0.python`" in err and ".engines/vllm/bin/python does not exist: run `make engines`" in err
    err = rejected(overridden(BASE, engines=[{"name": "v", "recipe": "vllm", "python": sys.executable,
                                               "serve": {"command": "{python} {port}"}}]))
    assert "`engines.0`" in err and "recipe vllm writes its own serve command; put further flags in `args`" in err
    err = rejected(overridden(BASE, engines=[{"name": "x"}]))
    assert "`engines.0`" in err and "needs a `recipe`" in err


def test_a_recipe_entry_passes_the_campaign_check_and_is_recorded_without_paths_or_secrets():
    cfg = overridden(BASE, engines=[{"name": "v", "recipe": "vllm", "python": sys.executable,
                                     "env": {"HF_TOKEN": "hf_abcdefgh", "CACHE": "/home/someone/cache"}}])
    validate_campaign(cfg, SCHEMA)
    e = cfg["engines"][0]
    assert e["kind"] == "openai" and e["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    recorded = yaml.safe_dump(evidence_config(cfg))
    assert "hf_abcdefgh" not in recorded and "/home/someone" not in recorded and sys.executable not in recorded
    assert "<secret>#" in recorded and "vllm.entrypoints.openai.api_server" in recorded


def test_an_entry_with_parity_false_is_served_to_the_bench_but_never_probed():
    cfg = overridden(BASE, engines=[{"name": "a", "kind": "openai", "url": "http://127.0.0.1:1/v1", "parity": False},
                                    {"name": "b", "kind": "command", "command": "{python} x.py {request} {out}"}])
    assert targets.names(cfg) == ["b"]
    assert targets.bench_targets(overridden(cfg, **{"bench.http.targets": None})) == ["engine", "a"]
    err = rejected(overridden(cfg, **{"engines.1.agrees_with": "a"}))
    assert "`engines.1.agrees_with`" in err and "neither entry may set parity: false" in err
    err = rejected(overridden(cfg, **{"engines.1.agrees_with": "c"}))
    assert "'c' is not another entry" in err


def test_a_template_keeps_json_braces_and_its_env_reaches_the_command(tmp_path):
    """Point 8: a JSON argument needs no doubled braces; `env` reaches the process (no `env` prefix)."""
    script = tmp_path / "echo.py"
    script.write_text("import json, os, sys\nreq = json.load(open(sys.argv[2]))\n"
                      "json.dump({'engine': os.environ['MY_FLAG'] + ' ' + sys.argv[1], 'cases': [{'name': c['name'], "
                      "'rows': [{'generated_ids': [1]}] * req['batch']} for c in req['cases']]}, open(sys.argv[3], 'w'))\n")
    spec = {"name": "echo", "kind": "command", "command": f"{{python}} {script} '{{\"a\": 1}}' {{request}} {{out}}",
            "env": {"MY_FLAG": "on"}}
    request = {"schema": "evident-request/1", "batch": 1, "top_k": 2,
               "cases": [{"name": "c", "prompt_ids": [0], "max_new_tokens": 1}]}
    trace = targets.run_command(spec, request, tmp_path / "work", tmp_path / "logs/x.log")
    assert trace["engine"] == 'on {"a": 1}'


def test_a_servers_readiness_limit_is_the_entrys_and_named_in_the_error(tmp_path):
    """Point 9: vLLM's first start took three minutes; the limit is per entry and the error says how to raise it."""
    port = targets.free_port()
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(targets.TargetError, match=r"was not ready within 1s .*raise the entry's ready_timeout_s"):
        with targets.served(argv, port, tmp_path / "logs/s.log", "a slow server", timeout=1):
            pass


class _Refusing(Fake):
    """llama.cpp's server as parity meets it: models listed, a prompt of ids answered 500, text answered."""
    text_fails = False

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if isinstance(body["prompt"], list) or self.text_fails:
            self.reply(500, {"error": "prompt must be a string"})
        else:
            self.reply(200, {"choices": [{"text": " ok", "finish_reason": "length"}]})


@pytest.fixture
def refusing():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    _Refusing.text_fails = False


def test_a_probes_5xx_falls_back_to_text_level_where_text_works(refusing):
    """Point 2: the probe's 500 no longer aborts the target; it is recorded, and the level is text."""
    client = targets.Client(refusing).connect()
    offered = targets.offers(client, [0, 5, 7], 4)
    assert targets.level(offered) == "text" and offered["refused"] == ['500: {"error": "prompt must be a string"}']
    assert targets.offers(client, [0, 5], 4, dialect="text")["refused"] == []  # text dialect: nothing probed
    _Refusing.text_fails = True  # a server that fails text too is broken: its error stands
    with pytest.raises(targets.ServerError, match="500"):
        targets.offers(client, [0, 5, 7], 4)


def test_the_served_model_id_never_puts_a_path_in_evidence():
    """Point 10: vLLM names a model by its checkpoint's absolute path unless told a name."""
    assert targets.model_id("/home/someone/ckpt/tiny").startswith("<path>/tiny#")
    assert targets.model_id("vllm") == "vllm" and targets.model_id(None) is None


# --- the comparison: a lowered KV cache, variant pairs, the free-running verdict kept -------------------------------

@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """The oracle and one token-level target run with a forced float32 run (the project's command adapter)."""
    from test_targets import CASES, COMMAND, PARITY, engine_on_path

    from evident.workflow.stages import oracle

    root = tmp_path_factory.mktemp("recipes")
    ckpt, ev = tinyev.make(root, tinyev.config(parity=PARITY, cases=CASES))
    oracle.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    with engine_on_path(root, None):
        parity_target.run(ckpt, ev, {"name": "a", "kind": "command", "command": COMMAND}, [1])
    return read_json(ev / "oracle/hf.json"), read_json(ev / "parity/a-b1.json"), ckpt


def _shifted(run: dict, by: float) -> dict:
    """The run with every forced log-prob moved by `by`: a cache's rounding as the logic check sees it."""
    run = copy.deepcopy(run)
    for c in run["cases"]:
        for row in c["forced"]["float32"]["rows"]:
            row["ref_logprobs"] = [[v + by for v in pos] for pos in row["ref_logprobs"]]
    return run


def test_a_declared_float16_kv_cache_that_fails_the_logic_check_is_named_as_the_cache(held):
    """Point 5: the same numbers are `engine_accuracy_gap` (wrong maths) for a target that says its cache is float32,
    and `kv_cache_precision_gap` for one that says float16; the free-running verdict is kept (point 4)."""
    oracle, run, _ = held
    assert compare.compare(oracle, [run])["verdict"] == "all_token_text_exact"
    bad = _shifted(run, 0.04)
    assert compare.compare(oracle, [bad])["verdict"] == "engine_accuracy_gap"
    bad["target"]["kv_cache_dtype"] = "float16"
    result = compare.compare(oracle, [bad])
    assert result["verdict"] == "kv_cache_precision_gap" and result["targets"]["a"]["kv_cache_dtype"] == "float16"
    assert result["first_divergence"]["kv_cache_dtype"] == "float16"
    assert {c["free_running"] for c in result["cells"]} == {"all_token_text_exact"}


def test_a_variant_pair_must_agree_token_for_token(held):
    from tokenizers import Tokenizer

    oracle, run, ckpt = held
    twin = copy.deepcopy(run)
    twin["backend"] = twin["target"]["name"] = "b"
    agree = compare.compare(oracle, [run, twin], pairs=[("a", "b")])
    assert agree["pairs"] == [{"a": "a", "b": "b", "verdict": "all_token_text_exact", "first_divergence": None}]
    case = twin["cases"][0]
    ids = case["rows"][0]["generated_ids"]
    ids[3] = (ids[3] + 1) % 512
    case["rows"][0] = parity_target.token_row(Tokenizer.from_file(str(ckpt / "tokenizer.json")), ids)
    part = compare.compare(oracle, [run, twin], pairs=[("a", "b")])
    assert part["pairs"][0]["verdict"] == "variant_mismatch" and part["pairs"][0]["first_divergence"]["step"] == 3
    assert part["verdict"] == "variant_mismatch"  # worse than the twin's own gap against the oracle


def test_a_text_level_divergence_where_the_oracle_holds_u_fffd_says_why(held):
    """Point 12: on random weights a server drops bytes that are not UTF-8 alone where transformers shows U+FFFD; the
    divergence says so instead of leaving the reader at a bare engine_accuracy_gap."""
    from test_targets import text_run

    oracle = copy.deepcopy(held[0])
    case = next(c for c in oracle["cases"] if "\ufffd" in c["served_text"])
    oracle["cases"] = [case]
    dropped = compare.compare(oracle, [text_run(oracle, [case["served_text"].replace("\ufffd", "")])])
    assert dropped["first_divergence"]["hint"] == compare.UNDECODABLE_HINT
    assert compare.compare(oracle, [text_run(oracle, [case["served_text"]])])["verdict"] == "text_only"


def test_a_kv_cache_dtype_the_recipe_cannot_set_is_refused(tmp_path):
    """A declared cache is recorded as what ran: a recipe without a flag for it must not let it be claimed."""
    err = rejected(overridden(BASE, engines=[{"name": "s", "recipe": "sglang", "python": sys.executable,
                                               "kv_cache_dtype": "float16"}]))
    assert "`engines.0.kv_cache_dtype`" in err and "recipe sglang has no flag for a float16 KV cache" in err
    cfg = overridden(BASE, engines=[{"name": "v", "recipe": "vllm", "python": sys.executable, "kv_cache_dtype": "float16"}])
    validate_campaign(cfg, SCHEMA)
    assert "--kv-cache-dtype float16" in cfg["engines"][0]["serve"]["command"]
