"""Unit tests for the parity verdict (workflow/stages/compare.py), on hand-built oracle and engine
records in the shapes that workflow/stages/oracle.py and workflow/stages/parity.py write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workflow.evidence import read_json, text_sha256, token_sha256
from workflow.stages import compare as cmp
from workflow.stages.compare import HashMismatch, check_hashes, compare
from workflow.stages.parity import first_row_mismatch

ROOT = Path(__file__).resolve().parents[1]
NEAR_TIE = 0.1
PROMPT = [0, 72, 101, 108, 108, 111]


def _text(ids: list[int]) -> str:
    """A stand-in for tokenizer.decode: any injective function of the ids will do."""
    return " ".join(f"t{i}" for i in ids)


def oracle_case(name: str, ids: list[int], margins: list[float] | None = None, prompt_ids=PROMPT) -> dict:
    text = _text(ids)
    return {
        "name": name, "prompt": f"prompt of {name}", "prompt_ids": list(prompt_ids),
        "generated_ids": list(ids), "text": text,
        "token_sha256": token_sha256(ids), "text_sha256": text_sha256(text),
        "margins": list(margins if margins is not None else [1.0] * len(ids)),
        "top2_ids": [[i, i + 1] for i in ids],
    }


def oracle(*cases: dict) -> dict:
    return {"implementation": "transformers.DeepseekV2ForCausalLM (native, eager)",
            "versions": {"torch": "x", "transformers": "y"}, "dtype": "float32", "device": "cpu",
            "cases": list(cases)}


def row(ids: list[int]) -> dict:
    text = _text(ids)
    return {"generated_ids": list(ids), "text": text, "token_sha256": token_sha256(ids), "text_sha256": text_sha256(text)}


def run_case(name: str, rows: list[list[int]], prompt_ids=PROMPT) -> dict:
    mismatch = first_row_mismatch(rows)
    return {"name": name, "prompt_ids": list(prompt_ids), "rows_identical": mismatch is None,
            "first_row_mismatch": mismatch, "margins": [2.0] * len(rows[0]), "rows": [row(r) for r in rows]}


def run(batch: int, *cases: dict, backend: str = "single") -> dict:
    return {"engine": "evident engine (engine/)", "backend": backend, "batch": batch,
            "dtype": "float32", "device": "cpu", "cases": list(cases)}


IDS_A = [10, 11, 12, 13, 14, 15]
IDS_B = [20, 21, 22, 23]
MARGINS_A = [3.0, 2.5, 0.01, 4.0, 0.05, 2.0]  # near-ties at steps 2 and 4


# --- verdicts ----------------------------------------------------------------------------


def test_all_equal_is_exact():
    o = oracle(oracle_case("a", IDS_A, MARGINS_A), oracle_case("b", IDS_B))
    runs = [run(1, run_case("a", [IDS_A]), run_case("b", [IDS_B])),
            run(4, run_case("a", [IDS_A] * 4), run_case("b", [IDS_B] * 4))]
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "all_token_text_exact"
    assert res["first_divergence"] is None
    assert res["near_tie_margin"] == NEAR_TIE
    assert len(res["cells"]) == 4
    assert {(c["backend"], c["batch"], c["case"]) for c in res["cells"]} == {
        ("single", 1, "a"), ("single", 1, "b"), ("single", 4, "a"), ("single", 4, "b")}
    assert all(c["verdict"] == "all_token_text_exact" and c["first_divergence"] is None for c in res["cells"])
    json.dumps(res)  # the result is written as JSON


def test_near_tie_divergence():
    engine = IDS_A[:2] + [99, 98, 97, 96]  # diverges at step 2, margin 0.01 < 0.1
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine]))], NEAR_TIE)
    assert res["verdict"] == "near_tie_divergence"
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 2, "oracle_token": 12,
                                       "engine_token": 99, "oracle_margin": 0.01}
    assert res["cells"][0]["verdict"] == "near_tie_divergence"


def test_divergence_above_margin_is_accuracy_gap():
    engine = IDS_A[:3] + [77] + IDS_A[4:]  # diverges at step 3, margin 4.0 >= 0.1
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine]))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 3, "oracle_token": 13,
                                       "engine_token": 77, "oracle_margin": 4.0}


def test_first_divergence_decides_not_a_later_near_tie():
    engine = IDS_A[:1] + [50] + IDS_A[2:3] + [51, 52, 53]  # first at step 1 (margin 2.5)
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine]))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"]["step"] == 1


def test_near_tie_threshold_is_strict_and_parameterised():
    engine = IDS_A[:2] + [99, 98, 97, 96]  # step 2, margin 0.01
    o = oracle(oracle_case("a", IDS_A, MARGINS_A))
    runs = [run(1, run_case("a", [engine]))]
    assert compare(o, runs, 0.01)["verdict"] == "engine_accuracy_gap"  # margin == threshold is not below it
    assert compare(o, runs, 0.0100001)["verdict"] == "near_tie_divergence"
    assert compare(o, runs, 0.0)["verdict"] == "engine_accuracy_gap"


def test_batch_row_mismatch_outranks_other_cells():
    o = oracle(oracle_case("a", IDS_A, MARGINS_A), oracle_case("b", IDS_B))
    gap = IDS_A[:3] + [77] + IDS_A[4:]
    near = IDS_A[:2] + [99, 98, 97, 96]
    bad_row = IDS_B[:2] + [55, 56]
    runs = [
        run(1, run_case("a", [gap]), run_case("b", [IDS_B])),  # an accuracy gap first
        run(4, run_case("a", [near] * 4), run_case("b", [IDS_B, IDS_B, bad_row, IDS_B])),
    ]
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "batch_row_mismatch"
    assert res["first_divergence"] == {"case": "b", "row": 2, "step": 2, "row0_token": 22, "row_token": 55}
    verdicts = {(c["batch"], c["case"]): c["verdict"] for c in res["cells"]}
    assert verdicts == {(1, "a"): "engine_accuracy_gap", (1, "b"): "all_token_text_exact",
                        (4, "a"): "near_tie_divergence", (4, "b"): "batch_row_mismatch"}


def test_batch_row_mismatch_checked_before_oracle():
    # Row 0 equals the oracle but another row does not: still a batch-row mismatch.
    o = oracle(oracle_case("a", IDS_A, MARGINS_A))
    res = compare(o, [run(2, run_case("a", [IDS_A, IDS_A[:4] + [1, 1]]))], NEAR_TIE)
    assert res["verdict"] == "batch_row_mismatch"
    assert res["first_divergence"]["case"] == "a" and res["first_divergence"]["row"] == 1
    assert res["first_divergence"]["step"] == 4


def test_worst_over_cells_near_tie_vs_gap():
    o = oracle(oracle_case("a", IDS_A, MARGINS_A), oracle_case("b", IDS_B, [1.0, 0.5, 0.5, 0.5]))
    runs = [run(1, run_case("a", [IDS_A[:2] + [99, 98, 97, 96]]), run_case("b", [IDS_B[:1] + [0, 0, 0]]))]
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"]["case"] == "b" and res["first_divergence"]["step"] == 1


def test_engine_stops_early_is_divergence_at_shorter_length():
    engine = IDS_A[:4]  # the engine ended after 4 tokens, the oracle went on
    o = oracle(oracle_case("a", IDS_A, MARGINS_A))
    res = compare(o, [run(1, run_case("a", [engine]))], NEAR_TIE)
    assert res["verdict"] == "near_tie_divergence"  # the oracle's margin at step 4 is 0.05 < 0.1
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 4, "oracle_token": 14,
                                       "engine_token": None, "oracle_margin": 0.05}
    assert compare(o, [run(1, run_case("a", [engine]))], 0.04)["verdict"] == "engine_accuracy_gap"


def test_engine_stops_early_at_decisive_step():
    engine = IDS_A[:3]
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine]))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 3, "oracle_token": 13,
                                       "engine_token": None, "oracle_margin": 4.0}


def test_engine_runs_longer_than_oracle():
    engine = IDS_A + [16, 17]  # the oracle stopped (eos) where the engine went on
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine]))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    div = res["first_divergence"]
    assert div["step"] == len(IDS_A) and div["oracle_token"] is None and div["engine_token"] == 16
    assert div["oracle_margin"] is None


def test_same_ids_different_text_is_not_exact():
    rc = run_case("a", [IDS_A])
    rc["rows"][0]["text"] = "something else"
    rc["rows"][0]["text_sha256"] = text_sha256("something else")
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, rc)], NEAR_TIE)
    assert res["verdict"] != "all_token_text_exact"
    assert res["first_divergence"]["case"] == "a"


# --- hash checks -------------------------------------------------------------------------


def test_check_hashes_accepts_consistent_entry():
    check_hashes("x", row(IDS_A))
    check_hashes("x", oracle_case("a", IDS_A))


def test_engine_token_hash_mismatch_names_cell():
    rc = run_case("greeting", [IDS_A] * 4)
    rc["rows"][2]["token_sha256"] = token_sha256(IDS_A[:-1])  # stored hash no longer matches the ids
    o = oracle(oracle_case("greeting", IDS_A))
    with pytest.raises(HashMismatch) as e:
        compare(o, [run(1, run_case("greeting", [IDS_A])), run(4, rc)], NEAR_TIE)
    msg = str(e.value)
    assert "single-b4" in msg and "greeting" in msg and "row 2" in msg and "token_sha256" in msg


def test_engine_ids_edited_after_hashing():
    rc = run_case("a", [IDS_A])
    rc["rows"][0]["generated_ids"] = IDS_A[:-1] + [0]  # the ids changed, the stored hash did not
    with pytest.raises(HashMismatch, match="single-b1 case a row 0"):
        compare(oracle(oracle_case("a", IDS_A)), [run(1, rc)], NEAR_TIE)


def test_engine_text_hash_mismatch():
    rc = run_case("a", [IDS_A])
    rc["rows"][0]["text_sha256"] = text_sha256("other")
    with pytest.raises(HashMismatch, match="text_sha256"):
        compare(oracle(oracle_case("a", IDS_A)), [run(1, rc)], NEAR_TIE)


def test_oracle_hash_mismatch_names_case():
    oc = oracle_case("code", IDS_B)
    oc["token_sha256"] = token_sha256(list(reversed(IDS_B)))
    with pytest.raises(HashMismatch, match="oracle case code"):
        compare(oracle(oc), [run(1, run_case("code", [IDS_B]))], NEAR_TIE)


def test_prompt_ids_differ():
    o = oracle(oracle_case("arithmetic", IDS_A))
    with pytest.raises(HashMismatch, match="arithmetic") as e:
        compare(o, [run(1, run_case("arithmetic", [IDS_A], prompt_ids=PROMPT[:-1] + [112]))], NEAR_TIE)
    assert "prompt" in str(e.value)


# --- the stage CLI -----------------------------------------------------------------------


def _evidence_dir(tmp: Path, parity: dict, o: dict, runs: dict[str, dict]) -> Path:
    ev = tmp / "ev"
    (ev / "oracle").mkdir(parents=True)
    (ev / "parity").mkdir()
    (ev / "config.yaml").write_text(yaml.safe_dump({"campaign": "tiny", "dtype": "float32", "parity": parity}))
    (ev / "oracle" / "hf.json").write_text(json.dumps(o))
    for name, r in runs.items():
        (ev / "parity" / f"{name}.json").write_text(json.dumps(r))
    return ev


def _run_cli(ev: Path, *runs: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "workflow.stages.compare", "--evidence", str(ev), *[str(ev / "parity" / f"{r}.json") for r in runs]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_cli_writes_comparison_and_stage_record(tmp_path):
    # margin 5e-5 is below float32's default noise (1e-4): a near-tie with near_tie_margin: null
    o = oracle(oracle_case("greeting", IDS_A, [1.0, 5e-5, 1.0, 1.0, 1.0, 1.0]), oracle_case("code", IDS_B))
    r = run(1, run_case("greeting", [IDS_A[:1] + [3, 3, 3, 3, 3]]), run_case("code", [IDS_B]))
    ev = _evidence_dir(tmp_path, {"near_tie_margin": None}, o, {"single-b1": r})
    p = _run_cli(ev, "single-b1")
    assert p.returncode == 0, p.stderr
    assert "near_tie_divergence" in p.stdout

    res = read_json(ev / "parity" / "comparison.json")
    assert res["verdict"] == "near_tie_divergence"
    assert res["near_tie_margin"] == cmp.NEAR_TIE["float32"]
    assert res["first_divergence"] == {"case": "greeting", "row": 0, "step": 1, "oracle_token": 11,
                                       "engine_token": 3, "oracle_margin": 5e-5}
    assert len(res["cells"]) == 2

    st = read_json(ev / "stages" / "compare.json")
    assert st["status"] == "ok"
    assert st["tags"]["verdict"] == "near_tie_divergence"
    assert st["params"]["near_tie_margin"] == cmp.NEAR_TIE["float32"]
    assert st["metrics"] == {"cells_exact": 1, "cells": 2}
    assert st["files"] == ["parity/comparison.json"]
    assert not [f for f in (ev / "parity").iterdir() if f.name.startswith(".")]  # no temp left


def test_cli_explicit_margin_and_several_runs(tmp_path):
    o = oracle(oracle_case("greeting", IDS_A, [1.0, 5e-5, 1.0, 1.0, 1.0, 1.0]))
    r1 = run(1, run_case("greeting", [IDS_A]))
    r2 = run(2, run_case("greeting", [IDS_A[:1] + [3, 3, 3, 3, 3]] * 2))
    ev = _evidence_dir(tmp_path, {"near_tie_margin": 1e-6}, o, {"single-b1": r1, "single-b2": r2})
    p = _run_cli(ev, "single-b1", "single-b2")
    assert p.returncode == 0, p.stderr
    res = read_json(ev / "parity" / "comparison.json")
    assert res["verdict"] == "engine_accuracy_gap"  # 5e-5 is above the configured 1e-6
    assert res["near_tie_margin"] == 1e-6
    assert [c["verdict"] for c in res["cells"]] == ["all_token_text_exact", "engine_accuracy_gap"]
    assert read_json(ev / "stages" / "compare.json")["tags"]["verdict"] == "engine_accuracy_gap"


def test_cli_hash_mismatch_fails_without_comparison(tmp_path):
    rc = run_case("greeting", [IDS_A])
    rc["rows"][0]["token_sha256"] = "0" * 64
    ev = _evidence_dir(tmp_path, {"near_tie_margin": None}, oracle(oracle_case("greeting", IDS_A)), {"single-b1": run(1, rc)})
    p = _run_cli(ev, "single-b1")
    assert p.returncode != 0
    assert "[compare] error" in p.stderr and "single-b1 case greeting row 0" in p.stderr
    assert not (ev / "parity" / "comparison.json").exists()
    st = read_json(ev / "stages" / "compare.json")
    assert st["status"] == "failed" and "HashMismatch" in st["error"]


def test_cli_zero_margin_is_honoured(tmp_path):
    o = oracle(oracle_case("greeting", IDS_A, [1.0, 5e-5, 1.0, 1.0, 1.0, 1.0]))
    r = run(1, run_case("greeting", [IDS_A[:1] + [3, 3, 3, 3, 3]]))
    ev = _evidence_dir(tmp_path, {"near_tie_margin": 0}, o, {"single-b1": r})
    p = _run_cli(ev, "single-b1")
    assert p.returncode == 0, p.stderr
    res = read_json(ev / "parity" / "comparison.json")
    assert res["near_tie_margin"] == 0
    assert res["verdict"] == "engine_accuracy_gap"


def test_run_missing_an_oracle_case_is_an_error():
    o = oracle(oracle_case("greeting", IDS_A, [1.0] * len(IDS_A)), oracle_case("other", IDS_A, [1.0] * len(IDS_A)))
    with pytest.raises(HashMismatch, match="differ from the oracle's"):
        compare(o, [run(1, run_case("greeting", [IDS_A]))], 1e-4)


def test_transports_that_disagree_are_a_transport_regression():
    o = oracle(oracle_case("greeting", IDS_A, [1.0] * len(IDS_A)))
    other = IDS_A[:3] + [99] + IDS_A[4:]
    runs = [run(2, run_case("greeting", [IDS_A, IDS_A]), backend="host-staged"),
            run(2, run_case("greeting", [other, other]), backend="collective")]
    result = compare(o, runs, 1e-4)
    assert result["verdict"] == "transport_regression"
    cell = next(c for c in result["cells"] if c["backend"] == "host-staged vs collective")
    assert cell["first_divergence"] == {"case": "greeting", "row": 0, "step": 3,
                                        "host_staged_token": IDS_A[3], "collective_token": 99}


def test_agreeing_transports_add_an_exact_cell():
    o = oracle(oracle_case("greeting", IDS_A, [1.0] * len(IDS_A)))
    runs = [run(1, run_case("greeting", [IDS_A]), backend=b) for b in ("single", "host-staged", "collective")]
    result = compare(o, runs, 1e-4)
    assert result["verdict"] == "all_token_text_exact"
    assert [c["verdict"] for c in result["cells"] if c["backend"] == "host-staged vs collective"] == ["all_token_text_exact"]


def test_kernels_settings_are_separate_cells_and_transport_pairs():
    """The Triton decode path's runs get their own cells; transports pair within one kernels setting."""
    o = oracle(oracle_case("a", [5, 6, 7]))

    def with_kernels(r: dict, kernels: str) -> dict:
        return {**r, "kernels": kernels}

    runs = [with_kernels(run(1, run_case("a", [[5, 6, 7]]), backend="host-staged"), "torch"),
            with_kernels(run(1, run_case("a", [[5, 6, 7]]), backend="collective"), "torch"),
            with_kernels(run(1, run_case("a", [[5, 6, 7]]), backend="host-staged"), "triton"),
            with_kernels(run(1, run_case("a", [[5, 6, 9]]), backend="collective"), "triton")]
    result = compare(o, runs, NEAR_TIE)
    transport = [c for c in result["cells"] if c["backend"] == "host-staged vs collective"]
    assert [(c["kernels"], c["verdict"]) for c in transport] == [("torch", "all_token_text_exact"),
                                                                 ("triton", "transport_regression")]
    assert {c["kernels"] for c in result["cells"]} == {"torch", "triton"}
    assert result["verdict"] == "transport_regression"
