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

from evident.workflow.core import verdicts
from evident.workflow.core.evidence import read_json, text_sha256, token_sha256
from evident.workflow.core.verdicts import SEVERITY
from evident.workflow.parity import logprobs
from evident.workflow.parity.logprobs import REFERENCE_DTYPE as F32
from evident.workflow.parity.traces import first_row_mismatch
from evident.workflow.stages import compare as cmp
from evident.workflow.stages.compare import HashMismatch, check_hashes, compare

ROOT = Path(__file__).resolve().parents[1]
NEAR_TIE = 0.1
TOL = cmp.LOGIC_TOLERANCE
PROMPT = [0, 72, 101, 108, 108, 111]
TOP_K = 4
BF16 = "bfloat16"
HF_ERROR = 2 ** -7  # transformers' own |Δ log-prob| in a bf16 campaign; log-probs are dyadic, so sums are exact


def _text(ids: list[int]) -> str:
    """A stand-in for tokenizer.decode: any injective function of the ids will do."""
    return " ".join(f"t{i}" for i in ids)


def reference(ids: list[int], prompt_ids=PROMPT) -> dict:
    """The float32 reference along prompt + ids: position p predicts token p + 1 of the path, its top-k that token
    and the ids after it. The log-probs depend on the token, so a forced run along another trace is out."""
    path = list(prompt_ids) + list(ids)
    return {"top_ids": [[t + j for j in range(TOP_K)] for t in path[1:]],
            "top_logprobs": [[-0.125 - (t % 16) / 128 - 2.0 * j for j in range(TOP_K)] for t in path[1:]]}


def shifted(logprobs: list[list[float]], by: float) -> list[list[float]]:
    return [[x + by for x in pos] for pos in logprobs]


def forced_run(ref: dict, batch: int, error: float = 0.0) -> dict:
    """A teacher-forced run of `batch` rows with the reference's top-k, its log-probs off by `error` (each row its own lists)."""
    return {"rows": [{"top_ids": [list(ids) for ids in ref["top_ids"]], "top_logprobs": shifted(ref["top_logprobs"], error),
                      "ref_logprobs": shifted(ref["top_logprobs"], error)} for _ in range(batch)]}


def oracle_case(name: str, ids: list[int], margins: list[float] | None = None, prompt_ids=PROMPT) -> dict:
    text = _text(ids)
    return {
        "name": name, "prompt": f"prompt of {name}", "prompt_ids": list(prompt_ids),
        "generated_ids": list(ids), "text": text,
        "token_sha256": token_sha256(ids), "text_sha256": text_sha256(text),
        "margins": list(margins if margins is not None else [1.0] * len(ids)),
        "top2_ids": [[i, i + 1] for i in ids],
        "reference": reference(ids, prompt_ids),
    }


def oracle(*cases: dict, dtype: str = F32) -> dict:
    """The oracle record; a bf16/fp16 campaign's cases carry transformers' own log-probs, off by HF_ERROR."""
    if dtype != F32:
        cases = tuple({**c, "same_dtype": {"ref_logprobs": shifted(c["reference"]["top_logprobs"], HF_ERROR),
                                           "top1": [ids[0] for ids in c["reference"]["top_ids"]]}} for c in cases)
    return {"implementation": "transformers.DeepseekV2ForCausalLM (native, eager)",
            "versions": {"torch": "x", "transformers": "y"}, "dtype": dtype, "device": "cpu",
            "reference": {"dtype": F32, "top_k": TOP_K}, "cases": list(cases)}


def row(ids: list[int]) -> dict:
    text = _text(ids)
    return {"generated_ids": list(ids), "text": text, "token_sha256": token_sha256(ids), "text_sha256": text_sha256(text)}


def run_case(name: str, rows: list[list[int]], trace: list[int] | None = None, prompt_ids=PROMPT, dtype: str = F32,
             error: float = HF_ERROR) -> dict:
    """An engine case: free-running `rows`, and forced runs along the oracle's `trace` (default rows[0], for a run
    whose row 0 is the oracle's): float32 exactly the reference, the campaign's dtype (if not float32) off by `error`."""
    ref = reference(rows[0] if trace is None else trace)
    forced = {F32: forced_run(ref, len(rows))}
    if dtype != F32:
        forced[dtype] = forced_run(ref, len(rows), error)
    mismatch = first_row_mismatch(rows)
    return {"name": name, "prompt_ids": list(prompt_ids), "rows_identical": mismatch is None,
            "first_row_mismatch": mismatch, "margins": [2.0] * len(rows[0]), "rows": [row(r) for r in rows],
            "forced": forced}


def run(batch: int, *cases: dict, backend: str = "single", dtype: str = F32) -> dict:
    return {"engine": "evident engine (engine/)", "backend": backend, "batch": batch,
            "dtype": dtype, "device": "cpu", "cases": list(cases)}


def nudge(case: dict, by: float, position: int = 7, k: int = 2, rows: list[int] | None = None, dtype: str = F32) -> dict:
    """Moves the forced log-prob of the reference's k-th id at `position` by `by` in the given rows (default all)."""
    forced = case["forced"][dtype]["rows"]
    for r in range(len(forced)) if rows is None else rows:
        forced[r]["ref_logprobs"][position][k] += by
    return case


IDS_A = [10, 11, 12, 13, 14, 15]
IDS_B = [20, 21, 22, 23]
MARGINS_A = [3.0, 2.5, 0.01, 4.0, 0.05, 2.0]  # near-ties at steps 2 and 4
CASES = {"a": (IDS_A, MARGINS_A), "b": (IDS_B, None)}
# position 7 of case a's path predicts step 2 (token 12); the reference's 3rd id there is 14
P7 = {"position": 7, "step": 2, "token": 14, "logprob": reference(IDS_A)["top_logprobs"][7][2]}


def bf16_campaign(errors: dict[str, float], engine: dict[str, list[int]] | None = None, batch: int = 1) -> tuple[dict, list]:
    """A bf16 campaign over the cases named in `errors`, one run: its forced bf16 log-probs off by errors[name]
    (transformers' by HF_ERROR), its float32 ones exact, its free-running rows engine[name] or the oracle's."""
    engine = engine or {}
    o = oracle(*(oracle_case(n, CASES[n][0], CASES[n][1]) for n in errors), dtype=BF16)
    cases = [run_case(n, [engine.get(n, CASES[n][0])] * batch, trace=CASES[n][0], dtype=BF16, error=e)
             for n, e in errors.items()]
    return o, [run(batch, *cases, dtype=BF16)]


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
    assert all(c["logic"]["pass"] and c["logic"]["max"] == 0 and c["logic"]["first_out"] is None for c in res["cells"])
    assert (res["logic_tolerance"], res["precision_bound"]) == (TOL, cmp.PRECISION_BOUND)
    assert [(f["batch"], f["logic"]["max"], f["logic"]["top1_agreement"], f["logic"]["positions"]) for f in res["forced"]] == [
        (1, 0.0, 1.0, 11 + 9), (4, 0.0, 1.0, 4 * (11 + 9))]
    assert all(f["precision"]["applies"] is False for f in res["forced"])  # a float32 campaign
    json.dumps(res)  # the result is written as JSON


def test_near_tie_divergence():
    engine = IDS_A[:2] + [99, 98, 97, 96]  # diverges at step 2, margin 0.01 < 0.1
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine], IDS_A))], NEAR_TIE)
    assert res["verdict"] == "near_tie_divergence"
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 2, "oracle_token": 12,
                                       "engine_token": 99, "oracle_margin": 0.01}
    assert res["cells"][0]["verdict"] == "near_tie_divergence"


def test_divergence_above_margin_is_accuracy_gap():
    engine = IDS_A[:3] + [77] + IDS_A[4:]  # diverges at step 3, margin 4.0 >= 0.1
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine], IDS_A))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 3, "oracle_token": 13,
                                       "engine_token": 77, "oracle_margin": 4.0}


def test_first_divergence_decides_not_a_later_near_tie():
    engine = IDS_A[:1] + [50] + IDS_A[2:3] + [51, 52, 53]  # first at step 1 (margin 2.5)
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine], IDS_A))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"]["step"] == 1


def test_near_tie_threshold_is_strict_and_parameterised():
    engine = IDS_A[:2] + [99, 98, 97, 96]  # step 2, margin 0.01
    o = oracle(oracle_case("a", IDS_A, MARGINS_A))
    runs = [run(1, run_case("a", [engine], IDS_A))]
    assert compare(o, runs, 0.01)["verdict"] == "engine_accuracy_gap"  # margin == threshold is not below it
    assert compare(o, runs, 0.0100001)["verdict"] == "near_tie_divergence"
    assert compare(o, runs, 0.0)["verdict"] == "engine_accuracy_gap"


def test_batch_row_mismatch_outranks_other_cells():
    o = oracle(oracle_case("a", IDS_A, MARGINS_A), oracle_case("b", IDS_B))
    gap = IDS_A[:3] + [77] + IDS_A[4:]
    near = IDS_A[:2] + [99, 98, 97, 96]
    bad_row = IDS_B[:2] + [55, 56]
    runs = [
        run(1, run_case("a", [gap], IDS_A), run_case("b", [IDS_B])),  # an accuracy gap first
        run(4, run_case("a", [near] * 4, IDS_A), run_case("b", [IDS_B, IDS_B, bad_row, IDS_B])),
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
    runs = [run(1, run_case("a", [IDS_A[:2] + [99, 98, 97, 96]], IDS_A), run_case("b", [IDS_B[:1] + [0, 0, 0]], IDS_B))]
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"]["case"] == "b" and res["first_divergence"]["step"] == 1


def test_engine_stops_early_is_divergence_at_shorter_length():
    engine = IDS_A[:4]  # the engine ended after 4 tokens, the oracle went on
    o = oracle(oracle_case("a", IDS_A, MARGINS_A))
    runs = [run(1, run_case("a", [engine], IDS_A))]
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "near_tie_divergence"  # the oracle's margin at step 4 is 0.05 < 0.1
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 4, "oracle_token": 14,
                                       "engine_token": None, "oracle_margin": 0.05}
    assert compare(o, runs, 0.04)["verdict"] == "engine_accuracy_gap"


def test_engine_stops_early_at_decisive_step():
    engine = IDS_A[:3]
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine], IDS_A))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 3, "oracle_token": 13,
                                       "engine_token": None, "oracle_margin": 4.0}


def test_engine_runs_longer_than_oracle():
    engine = IDS_A + [16, 17]  # the oracle stopped (eos) where the engine went on
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [engine], IDS_A))], NEAR_TIE)
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


# --- teacher-forced checks ------------------------------------------------------------------


def _cell(res: dict, case: str) -> dict:
    return next(c for c in res["cells"] if c["case"] == case)


def test_logic_gap_names_the_first_position_out():
    """Exact free-running tokens, but the float32 forced log-prob of one top-k id 2 * TOL off: an accuracy gap."""
    o = oracle(oracle_case("a", IDS_A, MARGINS_A), oracle_case("b", IDS_B))
    runs = [run(1, nudge(run_case("a", [IDS_A]), 2 * TOL), run_case("b", [IDS_B]))]
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    first_out = {"case": "a", "row": 0, "position": P7["position"], "step": P7["step"], "token": P7["token"],
                 "oracle_logprob": P7["logprob"], "engine_logprob": P7["logprob"] + 2 * TOL,
                 "abs_delta": pytest.approx(2 * TOL), "tolerance": TOL}
    assert res["first_divergence"] == first_out
    a = _cell(res, "a")
    assert a["verdict"] == "engine_accuracy_gap" and a["logic"]["pass"] is False and a["logic"]["first_out"] == first_out
    assert a["logic"]["max"] == pytest.approx(2 * TOL)
    assert _cell(res, "b")["verdict"] == "all_token_text_exact"
    assert res["forced"][0]["logic"]["max"] == pytest.approx(2 * TOL)  # pooled over the run's cases


def test_logic_check_covers_every_row_and_the_prompt():
    """Rows within the tolerance of each other, row 1 out inside the prompt (position 3, step -2): the first
    position out over all rows decides, not row 0's later one."""
    rc = nudge(nudge(run_case("a", [IDS_A] * 2), 0.8 * TOL, position=3, k=0, rows=[0]), 1.2 * TOL, position=3, k=0, rows=[1])
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(2, nudge(rc, 2 * TOL))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    ref = reference(IDS_A)["top_logprobs"][3][0]
    assert res["first_divergence"] == {"case": "a", "row": 1, "position": 3, "step": -2, "token": PROMPT[4],
                                       "oracle_logprob": ref, "engine_logprob": ref + 1.2 * TOL,
                                       "abs_delta": pytest.approx(1.2 * TOL), "tolerance": TOL}


@pytest.mark.parametrize("by, tol, verdict", [
    (2 * TOL, TOL, "engine_accuracy_gap"),
    (-2 * TOL, TOL, "engine_accuracy_gap"),  # |Δ|: below the reference as much as above it
    (2 ** -10, TOL, "all_token_text_exact"),  # 9.0.8 * TOL, under the default
    (2 ** -10, 2 ** -10, "all_token_text_exact"),  # |Δ| == tolerance is within it (dyadic: exact)
    (2 ** -10, 2 ** -11, "engine_accuracy_gap"),
])
def test_logic_tolerance_is_strict_and_parameterised(by, tol, verdict):
    o = oracle(oracle_case("a", IDS_A, MARGINS_A))
    res = compare(o, [run(2, nudge(run_case("a", [IDS_A] * 2), by))], NEAR_TIE, logic_tolerance=tol)
    assert res["verdict"] == verdict
    assert res["logic_tolerance"] == tol and res["cells"][0]["logic"]["tolerance"] == tol
    assert res["cells"][0]["logic"]["pass"] is (verdict == "all_token_text_exact")


def test_logic_gap_does_not_override_a_free_running_row_mismatch():
    rc = nudge(run_case("a", [IDS_A, IDS_A[:4] + [1, 1]]), 2 * TOL)
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(2, rc)], NEAR_TIE)
    assert res["verdict"] == "batch_row_mismatch"
    assert res["first_divergence"] == {"case": "a", "row": 1, "step": 4, "row0_token": 14, "row_token": 1}
    assert res["cells"][0]["logic"] is None and res["forced"][0]["logic"] is None  # not forced-checked


def test_logic_gap_keeps_a_free_running_gap_and_outranks_a_near_tie():
    o = oracle(oracle_case("a", IDS_A, MARGINS_A))
    gap, near = IDS_A[:3] + [77] + IDS_A[4:], IDS_A[:2] + [99, 98, 97, 96]
    res = compare(o, [run(1, nudge(run_case("a", [gap], IDS_A), 2 * TOL))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"] == {"case": "a", "row": 0, "step": 3, "oracle_token": 13,
                                       "engine_token": 77, "oracle_margin": 4.0}
    assert res["cells"][0]["logic"]["pass"] is False  # still reported
    res = compare(o, [run(1, nudge(run_case("a", [near], IDS_A), 2 * TOL))], NEAR_TIE)
    assert res["verdict"] == "engine_accuracy_gap"
    assert res["first_divergence"] == res["cells"][0]["logic"]["first_out"]
    assert res["first_divergence"]["position"] == P7["position"]


@pytest.mark.parametrize("campaign, dtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
@pytest.mark.parametrize("top1, by, delta", [(99, 0.0, 0.0), (12, 2 * TOL, pytest.approx(2 * TOL))])
def test_forced_rows_that_disagree_are_a_batch_row_mismatch(campaign, dtype, top1, by, delta):
    """Row 1 of the forced run in dtype: another top-1 at position 7 (99), or the same (12) but a log-prob 2 * TOL
    from row 0's. Rows must agree in the campaign dtype's run and in the float32 one."""
    o, runs = bf16_campaign({"a": HF_ERROR}, batch=2) if campaign == BF16 else (
        oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(2, run_case("a", [IDS_A] * 2))])
    rc = nudge(runs[0]["cases"][0], by, k=1, rows=[1], dtype=dtype)
    rc["forced"][dtype]["rows"][1]["top_ids"][7][0] = top1
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "batch_row_mismatch"
    assert res["first_divergence"] == {"case": "a", "row": 1, "dtype": dtype, "position": 7, "step": 2,
                                       "forced": True, "row0_token": 12, "row_token": top1,
                                       "max_abs_logprob_delta": delta, "tolerance": TOL}


def test_forced_rows_apart_within_the_tolerance_agree():
    rc = nudge(run_case("a", [IDS_A] * 2), 2 ** -10, rows=[1])
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(2, rc)], NEAR_TIE, logic_tolerance=2 ** -10)
    assert res["verdict"] == "all_token_text_exact"
    assert compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(2, rc)], NEAR_TIE,
                   logic_tolerance=2 ** -11)["first_divergence"]["forced"] is True


@pytest.mark.parametrize("campaign, drop", [(F32, None), (F32, F32), (BF16, F32), (BF16, BF16)])
def test_case_without_its_forced_run_is_an_error(campaign, drop):
    """drop: the dtype whose forced run is missing (None: no forced runs at all)."""
    cases = [run_case(n, [CASES[n][0]] * 2, dtype=campaign) for n in ("a", "b")]
    if drop is None:
        del cases[1]["forced"]
    else:
        del cases[1]["forced"][drop]
    o = oracle(*(oracle_case(n, CASES[n][0], CASES[n][1]) for n in ("a", "b")), dtype=campaign)
    with pytest.raises(HashMismatch, match=f"single-b2 case b: no teacher-forced run in {drop or F32}"):
        compare(o, [run(2, *cases, dtype=campaign)], NEAR_TIE)


def test_forced_run_along_another_path_is_an_error():
    """A forced run with fewer positions than the oracle's path is not compared position by position."""
    with pytest.raises(ValueError, match="against the reference's"):
        compare(oracle(oracle_case("a", IDS_A)), [run(1, run_case("a", [IDS_A[:4]]))], NEAR_TIE)


# --- the precision check (bf16, fp16 campaigns) -------------------------------------------


def test_precision_as_good_as_transformers_passes():
    o, runs = bf16_campaign({"a": HF_ERROR, "b": HF_ERROR}, batch=2)
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "all_token_text_exact"
    assert [c["case"] for c in res["cells"]] == ["a", "b"]  # no precision cell
    prec = res["forced"][0]["precision"]
    assert prec["applies"] is True and prec["dtype"] == BF16 and prec["pass"] is True
    assert (prec["ratio"], prec["case_ratios"], prec["bound"]) == (1.0, {"a": 1.0, "b": 1.0}, cmp.PRECISION_BOUND)
    assert prec["engine"]["mean"] == prec["transformers"]["mean"] == HF_ERROR
    assert prec["engine"]["positions"] == 2 * prec["transformers"]["positions"] == 2 * (11 + 9)  # every row
    assert res["forced"][0]["logic"]["max"] == 0.0  # the float32 run is exact


def test_precision_regression_with_the_logic_check_passing():
    o, runs = bf16_campaign({"a": 1.5 * HF_ERROR, "b": HF_ERROR})
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "precision_regression"
    pooled = (11 * 1.5 + 9) / 20  # a's 11 positions 1.5x, b's 9 1x
    assert res["first_divergence"] == {"cell": "single-b1", "dtype": BF16, "engine_mean": pytest.approx(pooled * HF_ERROR),
                                       "transformers_mean": HF_ERROR, "ratio": pytest.approx(pooled), "bound": cmp.PRECISION_BOUND}
    assert [(c["case"], c["verdict"]) for c in res["cells"]] == [
        ("a", "all_token_text_exact"), ("b", "all_token_text_exact"), ("all", "precision_regression")]
    assert all(c["logic"]["pass"] for c in res["cells"][:2])
    prec = res["forced"][0]["precision"]
    assert prec["pass"] is False and prec["case_ratios"] == {"a": 1.5, "b": 1.0}


def test_precision_bound_is_inclusive_and_parameterised():
    o, runs = bf16_campaign({"a": 1.5 * HF_ERROR, "b": 1.5 * HF_ERROR})
    assert compare(o, runs, NEAR_TIE)["verdict"] == "precision_regression"
    res = compare(o, runs, NEAR_TIE, precision_bound=1.5)
    assert res["verdict"] == "all_token_text_exact" and res["forced"][0]["precision"]["ratio"] == 1.5
    res = compare(o, runs, NEAR_TIE, precision_bound=1.49)
    assert res["verdict"] == "precision_regression" and res["first_divergence"]["bound"] == 1.49
    assert res["precision_bound"] == 1.49


def test_precision_error_below_transformers_passes():
    o, runs = bf16_campaign({"a": 0.0, "b": HF_ERROR})
    res = compare(o, runs, NEAR_TIE)
    assert res["verdict"] == "all_token_text_exact"
    prec = res["forced"][0]["precision"]
    assert prec["case_ratios"] == {"a": 0.0, "b": 1.0} and prec["ratio"] == pytest.approx(9 / 20)


def noisy_bf16_oracle(margin: float, noise: dict[int, float]) -> tuple[dict, list]:
    """A bf16 campaign whose transformers run is off by noise[p] (default HF_ERROR) on the top-1 and top-2 log-probs
    at case a's and b's positions p (11 and 9 of them), in opposite directions: a margin error of 2 * noise[p]. The
    engine's free run parts at step 2 of case a, at an oracle margin `margin`; its float32 run is exact and its
    bf16 error as transformers', so the margin alone decides."""
    o = oracle(oracle_case("a", IDS_A, [3.0, 2.5, margin, 4.0, 3.0, 2.0]), oracle_case("b", IDS_B), dtype=BF16)
    for i, p in enumerate(pos for c in o["cases"] for pos in c["same_dtype"]["ref_logprobs"]):
        n = noise.get(i, HF_ERROR)
        p[0], p[1] = p[0] + n - HF_ERROR, p[1] - n - HF_ERROR  # from the fixture's +HF_ERROR to +n and -n
    runs = [run(1, run_case("a", [IDS_A[:2] + [99, 98, 97, 96]], IDS_A, dtype=BF16), run_case("b", [IDS_B], dtype=BF16),
                dtype=BF16)]
    return o, runs


@pytest.mark.parametrize("margin,verdict", [(1.0, "near_tie_divergence"), (1.5, "engine_accuracy_gap"),
                                            (2.0, "engine_accuracy_gap")])
def test_bf16_near_tie_margin_is_transformers_own_noise(margin, verdict):
    """Transformers' own bf16 run moves every margin by 1.5 nats: a divergence strictly below that is a near tie,
    at or above it an accuracy gap (the floor 0.5 would call all three gaps)."""
    o, runs = noisy_bf16_oracle(margin, {i: 0.75 for i in range(20)})
    res = compare(o, runs)
    assert res["near_tie_margin"] == pytest.approx(1.5)
    assert res["near_tie_noise"] == {"quantile": logprobs.NOISE_QUANTILE, "positions": 20,
                                     "transformers_margin_error": pytest.approx(1.5), "floor": verdicts.NEAR_TIE[BF16]}
    assert res["forced"][0]["precision"]["pass"] and _cell(res, "a")["logic"]["pass"]
    assert _cell(res, "a")["verdict"] == verdict and res["verdict"] == verdict
    fixed = compare(o, runs, 1.25)  # a margin the campaign fixes is used as it is
    assert fixed["near_tie_margin"] == 1.25 and fixed["near_tie_noise"] is None
    assert fixed["verdict"] == ("near_tie_divergence" if margin < 1.25 else "engine_accuracy_gap")


def test_bf16_near_tie_margin_is_not_raised_by_one_outlier():
    """One position where transformers' rounding moves a margin by 16 nats (a routing choice flipped), 19 where it
    moves it by 2 * HF_ERROR: the 95% quantile stays under the floor, so a divergence at margin 1.0 stays a gap."""
    o, runs = noisy_bf16_oracle(1.0, {13: 8.0})
    res = compare(o, runs)
    assert res["near_tie_margin"] == verdicts.NEAR_TIE[BF16] and res["near_tie_noise"]["transformers_margin_error"] < 0.5
    assert res["verdict"] == "engine_accuracy_gap"


def test_float32_near_tie_margin_is_the_floor():
    """A float32 campaign has no transformers run in another dtype: its margin is float32's, whatever the path."""
    res = compare(oracle(oracle_case("a", IDS_A, MARGINS_A)), [run(1, run_case("a", [IDS_A]))])
    assert res["near_tie_margin"] == verdicts.NEAR_TIE[F32] and res["near_tie_noise"] is None


def test_precision_regression_ranks_between_near_tie_and_accuracy_gap():
    assert (SEVERITY.index("near_tie_divergence") < SEVERITY.index("precision_regression")
            < SEVERITY.index("engine_accuracy_gap"))

    def result(engine: list[int], logic_off: float = 0.0) -> dict:
        o, runs = bf16_campaign({"a": 1.5 * HF_ERROR}, {"a": engine})
        nudge(runs[0]["cases"][0], logic_off)
        return compare(o, runs, NEAR_TIE)

    assert result(IDS_A[:2] + [99, 98, 97, 96])["verdict"] == "precision_regression"  # over a near-tie at step 2
    # a decisive free-running divergence (step 3) whose float32 run is right: the precision check names it
    decisive = result(IDS_A[:3] + [77] + IDS_A[4:])
    assert decisive["verdict"] == "precision_regression"
    cell = _cell(decisive, "a")
    assert cell["verdict"] == "precision_regression" and cell["first_divergence"]["step"] == 3
    assert cell["first_divergence"]["ratio"] == pytest.approx(1.5)
    # the same divergence with a wrong float32 run stays an accuracy gap
    assert result(IDS_A[:3] + [77] + IDS_A[4:], logic_off=2 * TOL)["verdict"] == "engine_accuracy_gap"


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
    parity = {"logic_tolerance": TOL, "precision_bound": cmp.PRECISION_BOUND, **parity}  # the schema's defaults
    (ev / "config.yaml").write_text(yaml.safe_dump({"campaign": "tiny", "dtype": o["dtype"], "parity": parity}))
    (ev / "oracle" / "hf.json").write_text(json.dumps(o))
    for name, r in runs.items():
        (ev / "parity" / f"{name}.json").write_text(json.dumps(r))
    return ev


def _run_cli(ev: Path, *runs: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "evident.workflow.stages.compare", "--evidence", str(ev), *[str(ev / "parity" / f"{r}.json") for r in runs]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_cli_writes_comparison_and_stage_record(tmp_path):
    # margin 5e-5 is below float32's default noise (1e-4): a near-tie with near_tie_margin: null
    o = oracle(oracle_case("greeting", IDS_A, [1.0, 5e-5, 1.0, 1.0, 1.0, 1.0]), oracle_case("code", IDS_B))
    r = run(1, run_case("greeting", [IDS_A[:1] + [3, 3, 3, 3, 3]], IDS_A), run_case("code", [IDS_B]))
    ev = _evidence_dir(tmp_path, {"near_tie_margin": None}, o, {"single-b1": r})
    p = _run_cli(ev, "single-b1")
    assert p.returncode == 0, p.stderr
    assert "near_tie_divergence" in p.stdout

    res = read_json(ev / "parity" / "comparison.json")
    assert res["verdict"] == "near_tie_divergence"
    assert res["near_tie_margin"] == verdicts.NEAR_TIE["float32"]
    assert res["first_divergence"] == {"case": "greeting", "row": 0, "step": 1, "oracle_token": 11,
                                       "engine_token": 3, "oracle_margin": 5e-5}
    assert len(res["cells"]) == 2

    st = read_json(ev / "stages" / "compare.json")
    assert st["status"] == "ok"
    assert st["tags"]["parity.verdict"] == "near_tie_divergence"
    assert st["params"] == {"near_tie_margin": verdicts.NEAR_TIE["float32"], "logic_tolerance": TOL, "precision_bound": cmp.PRECISION_BOUND}
    assert st["metrics"] == {"cells_exact": 1, "cells": 2, "logic_max_abs_delta": 0.0}  # no precision ratio in float32
    assert st["files"] == ["parity/comparison.json"]
    assert not [f for f in (ev / "parity").iterdir() if f.name.startswith(".")]  # no temp left


def test_cli_explicit_margin_and_several_runs(tmp_path):
    o = oracle(oracle_case("greeting", IDS_A, [1.0, 5e-5, 1.0, 1.0, 1.0, 1.0]))
    r1 = run(1, run_case("greeting", [IDS_A]))
    r2 = run(2, run_case("greeting", [IDS_A[:1] + [3, 3, 3, 3, 3]] * 2, IDS_A))
    ev = _evidence_dir(tmp_path, {"near_tie_margin": 1e-6}, o, {"single-b1": r1, "single-b2": r2})
    p = _run_cli(ev, "single-b1", "single-b2")
    assert p.returncode == 0, p.stderr
    res = read_json(ev / "parity" / "comparison.json")
    assert res["verdict"] == "engine_accuracy_gap"  # 5e-5 is above the configured 1e-6
    assert res["near_tie_margin"] == 1e-6
    assert [c["verdict"] for c in res["cells"]] == ["all_token_text_exact", "engine_accuracy_gap"]
    assert read_json(ev / "stages" / "compare.json")["tags"]["parity.verdict"] == "engine_accuracy_gap"


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
    r = run(1, run_case("greeting", [IDS_A[:1] + [3, 3, 3, 3, 3]], IDS_A))
    ev = _evidence_dir(tmp_path, {"near_tie_margin": 0}, o, {"single-b1": r})
    p = _run_cli(ev, "single-b1")
    assert p.returncode == 0, p.stderr
    res = read_json(ev / "parity" / "comparison.json")
    assert res["near_tie_margin"] == 0
    assert res["verdict"] == "engine_accuracy_gap"


def test_cli_reads_logic_tolerance_and_precision_bound(tmp_path):
    """A bf16 campaign: 1.5x transformers' error passes the configured bound 1.6 (not the default 1.15), and a
    float32 log-prob 2**-10 off fails the configured tolerance 2**-11 (not the default)."""
    o, runs = bf16_campaign({"a": 1.5 * HF_ERROR, "b": 1.5 * HF_ERROR})
    nudge(runs[0]["cases"][0], 2 ** -10)
    parity = {"near_tie_margin": None, "logic_tolerance": 2 ** -11, "precision_bound": 1.6}
    ev = _evidence_dir(tmp_path, parity, o, {"single-b1": runs[0]})
    p = _run_cli(ev, "single-b1")
    assert p.returncode == 0, p.stderr
    res = read_json(ev / "parity" / "comparison.json")
    assert res["verdict"] == "engine_accuracy_gap" and res["first_divergence"]["tolerance"] == 2 ** -11
    assert [c["case"] for c in res["cells"]] == ["a", "b"]  # no precision_regression cell
    st = read_json(ev / "stages" / "compare.json")
    assert st["params"] == {"near_tie_margin": verdicts.NEAR_TIE[BF16], "logic_tolerance": 2 ** -11, "precision_bound": 1.6}
    assert st["metrics"] == {"cells_exact": 1, "cells": 2, "logic_max_abs_delta": 2 ** -10, "precision_ratio_max": 1.5}


def test_run_missing_an_oracle_case_is_an_error():
    o = oracle(oracle_case("greeting", IDS_A, [1.0] * len(IDS_A)), oracle_case("other", IDS_A, [1.0] * len(IDS_A)))
    with pytest.raises(HashMismatch, match="differ from the oracle's"):
        compare(o, [run(1, run_case("greeting", [IDS_A]))], 1e-4)


def test_transports_that_disagree_are_a_transport_regression():
    o = oracle(oracle_case("greeting", IDS_A, [1.0] * len(IDS_A)))
    other = IDS_A[:3] + [99] + IDS_A[4:]
    runs = [run(2, run_case("greeting", [IDS_A, IDS_A]), backend="host-staged"),
            run(2, run_case("greeting", [other, other], IDS_A), backend="collective")]
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
            with_kernels(run(1, run_case("a", [[5, 6, 9]], [5, 6, 7]), backend="collective"), "triton")]
    result = compare(o, runs, NEAR_TIE)
    transport = [c for c in result["cells"] if c["backend"] == "host-staged vs collective"]
    assert [(c["kernels"], c["verdict"]) for c in transport] == [("torch", "all_token_text_exact"),
                                                                 ("triton", "transport_regression")]
    assert {c["kernels"] for c in result["cells"]} == {"torch", "triton"}
    assert result["verdict"] == "transport_regression"


def test_the_compare_defaults_are_the_schemas():
    """compare()'s defaults and the campaign schema's state one tolerance and one bound."""
    schema = yaml.safe_load((ROOT / "config/schema.yaml").read_text())["properties"]["parity"]["properties"]
    assert schema["logic_tolerance"]["default"] == cmp.LOGIC_TOLERANCE
    assert schema["precision_bound"]["default"] == cmp.PRECISION_BOUND


def test_summary_parity_matrix_has_one_row_per_backend_path_batch():
    """SUMMARY.md's parity table: a row per run (not per case) with the forced figures, and each distinct first
    divergence listed once with the cells it occurs in."""
    from evident.workflow.archive.summary import parity_section

    o, runs = bf16_campaign({"a": 1.5 * HF_ERROR, "b": 1.5 * HF_ERROR}, batch=2)
    res = compare(o, runs + [{**runs[0], "kernels": "graph"}], NEAR_TIE)
    text = "\n".join(parity_section(res, BF16, 4))
    rows = [line for line in text.splitlines() if line.startswith("| single")]
    assert [r.split("|")[2].strip() for r in rows] == ["torch", "graph"]
    assert all("0/2 exact" not in r and "2/2 exact" in r and "**1.500**" in r and "`precision_regression`" in r
               for r in rows)
    assert "mean |Δ| 0.0117 vs transformers' 0.0078: 1.500x > 1.15x (single torch b2, single graph b2)" in text
