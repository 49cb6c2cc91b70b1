"""The quality gate on trained weights sees engine bugs that change answers. Small known bugs (tests/mutants.py),
each applied to a scratch copy of the engine and served on its own OpenAI-compatible endpoint, are gated against
transformers on the default campaign's trained checkpoint (the default run's, shared), in float32 (all six logic
mutants) and in bfloat16 (the same weights rounded; the one that flips answers). The unmutated engine, the stage's
own `engine` target, must pass and part from transformers' completions at near-ties only; a mutant's flips must be
listed, and fail the gate. In float32, transformers' and the engine's completions are the default run's own quality
stage's (the same checkpoint, data, contract and dtype), replayed. `pytest -s` prints the table.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import cluster
import mutants
import pytest
import torch
import yaml

from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json, text_sha256, write_text
from evident.workflow.core.verdicts import NEAR_TIE
from evident.workflow.models import checkpoints

pytestmark = [pytest.mark.slow, cluster.waits_for_default_run]
DTYPES = ("float32", "bfloat16")
# The logic mutant that flips most answers (62 of 64 on the current trainer's weights: docs/campaigns.md "Trained checkpoints") in both dtypes, whatever
# CPU trained the model: it must fail.
# The others flip a few answers or none, and which depends on the trained weights, which repeat on one machine but
# not, it seems, across machines (the same seed, code and torch): route_drop_smallest and softmax_scale_x1.01 flipped
# answers where this was first measured, and none on another machine, where they changed 1 completion of 64.
# Whatever they change, the gate must list exactly their flips and fail on any
# (test_the_gate_lists_every_flip_and_fails_on_any); a mutant that changes no answer passes the quality gate, and the
# parity logic check is what sees it.
FLIPPING = ("yarn_hard_ramp",)
# every logic mutant in float32 (the table); in bf16 the flipping one, to keep the suite's time (a mutant the gate
# passes, as route_drop_smallest did in bf16, float32 shows five times over)
MEASURED = {"float32": mutants.LOGIC, "bfloat16": FLIPPING}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """The default run's trained checkpoint and the default campaign, resolved as that run resolved it."""
    from evident.workflow.plan.campaign import evidence_config, validate_campaign

    ckpt = cluster.trained_checkpoint(tmp_path_factory)
    config = yaml.safe_load((mutants.REPO / "config/config.yaml").read_text())
    validate_campaign(config, str(mutants.REPO / "config/schema.yaml"))
    return ckpt, evidence_config(config)


def rounded(ckpt: Path, out: Path, dtype: str) -> Path:
    """The checkpoint's weights in `dtype`, as the trainer writes them for a campaign of that dtype."""
    from safetensors.torch import load_file

    out.mkdir(parents=True)
    checkpoints.write_weights(out, load_file(ckpt / "model.safetensors"), dtype)
    cfg = {**read_json(ckpt / "config.json"), "torch_dtype": dtype}
    checkpoints.write_model_files(out, cfg)
    write_text(out / "evident_trained.json", (ckpt / "evident_trained.json").read_text())
    return out


def replayed(default: Path, name: str, items: list[dict], cfg: dict, dtype: str) -> tuple[list[str], dict]:
    """Target `name`'s completions and record from the default run's quality stage (default: a copy of its quality/),
    as the stage's run_hf and run_engine return them; held to the same questions, prompts, contract and dtype."""
    from evident.workflow.parity import gsm8k

    result = read_json(default / Path(layout.quality_result(name)).name)
    rows = [json.loads(line) for line in (default / Path(layout.quality_rows(name)).name).read_text().splitlines()]
    assert (result["dtype"], result["contract"]) == (dtype, gsm8k.contract(cfg)), (name, result)
    assert [(r["id"], r["prompt_sha256"], r["gold"]) for r in rows] == [
        (it["id"], text_sha256(it["prompt"]), it["gold"]) for it in items], name
    return [r["completion"] for r in rows], {k: result[k] for k in ("implementation", "server_ready_s", "versions")
                                             if k in result}


@contextlib.contextmanager
def replaying(default: Path):
    """The quality stage with its hf and engine targets replayed from the default run's: computed again here, on the
    same checkpoint, data, contract and dtype, they would be the same completions (64 generations each, and an engine
    server's start)."""
    from evident.workflow.stages import quality

    def engine(ckpt, evidence, items, cfg, dtype, device, log):
        # the stage adds the engine server's log to its files
        write_text(evidence / quality.ENGINE_LOG, "replayed from the default run's quality stage\n")
        return replayed(default, "engine", items, cfg, dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quality, "run_hf", lambda ckpt, items, cfg, dtype, device, log: replayed(default, "hf", items, cfg,
                                                                                              dtype))
        mp.setattr(quality, "run_engine", engine)
        yield


@pytest.fixture(scope="module")
def gates(trained, tmp_path_factory) -> dict:
    """{dtype: {candidate: gate}} from one quality stage a dtype: hf, the engine and every mutant's endpoint."""
    from evident.workflow.stages import checkpoint as record_stage
    from evident.workflow.stages import quality

    ckpt32, config = trained
    assert config["dtype"] == "float32"  # the default campaign's, whose quality stage is replayed below
    default = cluster.default_quality(tmp_path_factory)
    root = tmp_path_factory.mktemp("quality-mutants")
    ckpts = {dtype: ckpt32 if dtype == "float32" else rounded(ckpt32, root / f"ckpt-{dtype}", dtype) for dtype in DTYPES}
    out = {}
    # every mutant's endpoint of both dtypes started at once (seconds each, one after another), stopped at the end
    with mutants.serving({(dtype, m): (root / f"{dtype}-{m}", m, ckpts[dtype], dtype)
                          for dtype in DTYPES for m in MEASURED[dtype]}) as served:
        for dtype in DTYPES:
            ckpt = ckpts[dtype]
            cfg = copy.deepcopy(config)
            cfg["dtype"] = dtype
            names = MEASURED[dtype]
            cfg["quality"]["targets"] = ["hf", "engine"] + [{"name": mutants.endpoint_name(m), "url": "<url>"}
                                                            for m in names]
            ev = root / f"ev-{dtype}"
            ev.mkdir()
            write_text(ev / "config.yaml", yaml.safe_dump(cfg, sort_keys=True))
            record_stage.record(ckpt, ev)
            urls = {mutants.endpoint_name(m): served[dtype, m] for m in names}
            with replaying(default) if dtype == config["dtype"] else contextlib.nullcontext():
                doc = quality.run(ckpt, ev, endpoints=urls)
            out[dtype] = {g["candidate"]: g for g in doc["gates"]}
            out[dtype]["hf"] = read_json(ev / "quality/gsm8k-hf.json")
            out[dtype]["rows"] = {name: {r["id"]: r for r in map(json.loads, (ev / f"quality/gsm8k-{name}-rows.jsonl")
                                                                   .read_text().splitlines())}
                                  for name in ["hf", "engine", *urls]}
            out[dtype]["ckpt"], out[dtype]["config"] = ckpt, cfg
    print("\ncandidate | dtype | verdict | correct (hf) | identical completions | flips")
    for dtype, by in out.items():
        for name, g in by.items():
            if isinstance(g, dict) and "verdict" in g:  # the gates, not the rows, checkpoint and config beside them
                print(f"{name} | {dtype} | {g['verdict']} | {g['counts']} | {len(g['flips'])}: "
                      + ", ".join(f"q{f['id']} {f['reference']}->{f['candidate']}" for f in g["flips"]))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_trained_reference_answers_most_held_out_questions(gates, dtype):
    hf = gates[dtype]["hf"]
    assert hf["accuracy"] >= 0.5 and hf["n"] == 64, hf


def partings(by: dict, name: str) -> dict[int, float]:
    """{question: the reference's margin where `name`'s completion first parts from transformers'}: transformers'
    log-prob of its own token there less that of `name`'s token, in the campaign's dtype."""
    from evident.workflow.models import hf
    from evident.workflow.parity import gsm8k

    rows, q = by["rows"], by["config"]["quality"]["gsm8k"]
    apart = [i for i, r in rows[name].items() if r["completion"] != rows["hf"][i]["completion"]]
    if not apart:
        return {}
    items = gsm8k.build_prompts(gsm8k.load_split(q, "test")[0], gsm8k.load_split(q, "train")[0], q["limit"], q["shots"])
    tok, model = hf.load(by["ckpt"], by["config"]["dtype"], "cpu")
    out = {}
    for i in apart:
        ref, got = (tok(rows[n][i]["completion"], add_special_tokens=False)["input_ids"] for n in ("hf", name))
        k = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if k is None:  # one stops where the other goes on: no token to compare, never a near-tie
            out[i] = float("inf")
            continue
        with torch.inference_mode():
            lp = model(torch.tensor([tok(items[i]["prompt"])["input_ids"] + ref[:k]])).logits[0, -1].float()
        out[i] = (lp[ref[k]] - lp[got[k]]).item()  # logits' difference: the log-probs'
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_unmutated_engine_passes_and_parts_from_transformers_at_near_ties_only(gates, dtype):
    """The engine must pass, and where its completion parts from transformers' (its kernels sum in fp32, in another
    order than transformers' matmuls) transformers' own margin there must be under the dtype's near-tie margin
    (workflow/core/verdicts.py NEAR_TIE, as parity's). bf16 on one machine's trained weights: 2 of 64 part, at the
    first token, at margins 0.0 and 0.06 (docs/campaigns.md "Trained checkpoints"); the yarn mutant's first parting is decisive (the test below)."""
    g = gates[dtype]["engine"]
    assert g["verdict"] == "pass" and g["rows"] == 64 and not g["flips"], g
    apart = partings(gates[dtype], "engine")
    assert all(m < NEAR_TIE[dtype] for m in apart.values()), apart


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_near_tie_check_sees_a_mutant_that_changes_answers(gates, dtype):
    """The check above would fail on a real defect: yarn_hard_ramp parts from transformers at margins past it."""
    apart = partings(gates[dtype], mutants.endpoint_name(FLIPPING[0]))
    assert max(apart.values()) >= NEAR_TIE[dtype], apart


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mutant", FLIPPING)
def test_a_mutant_that_flips_answers_fails_with_its_flips_listed(gates, dtype, mutant):
    g = gates[dtype][mutants.endpoint_name(mutant)]
    assert g["verdict"] in ("fail", "fail_flips") and g["flips"], g
    assert all(f["reference"] == f["gold"] and f["candidate"] != f["gold"] for f in g["flips"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gate_lists_every_flip_and_fails_on_any(gates, dtype):
    """Whichever answers a mutant changes on these weights, the gate's flips are exactly the questions the reference
    answers right and the mutant wrong, read from the two endpoints' rows, and a flip fails the gate."""
    rows = gates[dtype]["rows"]
    for name in map(mutants.endpoint_name, MEASURED[dtype]):
        g = gates[dtype][name]
        want = sorted(i for i, r in rows[name].items() if rows["hf"][i]["ok"] and not r["ok"])
        assert sorted(f["id"] for f in g["flips"]) == want, (name, g)
        assert not want or g["verdict"] in ("fail", "fail_flips"), (name, g)
