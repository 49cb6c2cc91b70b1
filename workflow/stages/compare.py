"""Stage `compare`: the parity verdict of every backend, decode path and batch size against the HF oracle.

Free-running: stored hashes must match their ids (else an error), rows of a batch must be identical
(`batch_row_mismatch`), then row 0 against the oracle: equal (`all_token_text_exact`), first divergence at an
oracle margin below the dtype's noise (`near_tie_divergence`, see `logprobs.near_tie_margin`), or above it
(`engine_accuracy_gap`). A free-running trace says nothing after its first divergence, and in bf16 small logic
bugs hide under the rounding, so two checks along the oracle's trace (teacher-forced, every row) decide too:

- logic check: the engine in float32 against the float32 oracle, max |Δ log-prob| over the oracle's top-k at
  every position within `parity.logic_tolerance`, else `engine_accuracy_gap` naming the first position out;
- precision check (bf16, fp16 campaigns): the engine's mean |Δ| against the float32 oracle in the campaign's
  dtype over transformers' own in that dtype, at most `parity.precision_bound`, else `precision_regression`.

A decisive free-running divergence whose float32 run passes the logic check is then the precision check's to
name: `precision_regression` where that fails (bf16 rounding parts traces even at decisive margins), else it
stays `engine_accuracy_gap`. Rows of a batch must agree in the forced runs too. Separately, the two
expert-parallel transports must agree token for token (`transport_regression` otherwise). The worst verdict over
all cells is the campaign's.

Engine targets (`engines:`, parity/<name>-b<B>.json) go through the same path at token level, their forced checks
where their forced run is in a dtype a check uses (`target_checks`: what is not checked, and why, is recorded under
`targets`); at text level through `text_case`. A target that declares its KV cache below its compute dtype and fails
the logic check gets `kv_cache_precision_gap`. The entries of a variant pair (`agrees_with`) must agree with each
other, row 0 of each case and batch size, token for token (`pair_cells`; text where either is text level).
Each cell keeps its free-running verdict (`free_running`) beside the one the forced checks left.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from evident.workflow.bench import replay
from evident.workflow.core import gates, layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args, text_sha256, token_sha256
from evident.workflow.core.verdicts import NEAR_TIE
from evident.workflow.core.verdicts import worst as worst_verdict
from evident.workflow.parity import logprobs
from evident.workflow.parity.logprobs import REFERENCE_DTYPE
from evident.workflow.parity.traces import REPLACEMENT, UNDECODABLE, first_difference, token_at
from evident.workflow.plan import targets
from evident.workflow.plan.runs import EP_BACKENDS, schema_default
from evident.workflow.plan.runs import label as run_label

TRANSPORTS = EP_BACKENDS  # host-staged against collective
# The schema's defaults, from the figures in docs/campaigns.md "Parity": 8x the largest float32 noise measured, and between
# transformers' own bf16 error and a low-dtype norm's.
LOGIC_TOLERANCE = schema_default("parity", "logic_tolerance")  # 5e-3
PRECISION_BOUND = schema_default("parity", "precision_bound")  # 1.15


class HashMismatch(ValueError):
    pass


def check_hashes(where: str, entry: dict) -> None:
    """The stored hashes of a row (a text-level target's rows have text only)."""
    ids, text = entry.get("generated_ids"), entry["text"]
    if ids is not None and entry["token_sha256"] != token_sha256(ids):
        raise HashMismatch(f"{where}: stored token_sha256 does not match its ids")
    if entry["text_sha256"] != text_sha256(text):
        raise HashMismatch(f"{where}: stored text_sha256 does not match its text")


def compare_case(oracle: dict, case: dict, near_tie: float) -> tuple[str, dict | None]:
    if case["prompt_ids"] != oracle["prompt_ids"]:
        raise HashMismatch(f"case {case['name']}: engine and oracle prompt ids differ")
    if not case["rows_identical"]:
        m = case["first_row_mismatch"]
        return "batch_row_mismatch", {"case": case["name"], **m}
    want, got = oracle["generated_ids"], case["rows"][0]["generated_ids"]
    if want == got and case["rows"][0]["text"] == oracle["text"]:
        return "all_token_text_exact", None
    step = first_difference(want, got)
    step = len(want) if step is None else step  # same ids, different text: a decode gap after the last token
    margin = token_at(oracle["margins"], step)
    div = {"case": case["name"], "row": 0, "step": step, "oracle_token": token_at(want, step),
           "engine_token": token_at(got, step), "oracle_margin": margin}
    verdict = "near_tie_divergence" if margin is not None and margin < near_tie else "engine_accuracy_gap"
    return verdict, div


# a text-level divergence where the oracle's text holds U+FFFD by then: text cannot show whether the tokens differ
UNDECODABLE_HINT = (f"the oracle's text holds U+FFFD by here: {UNDECODABLE}; text cannot show whether the tokens "
                    "differ: compare at token level, or on a trained checkpoint whose text is UTF-8")


def text_case(oracle: dict, case: dict, near_tie: float) -> tuple[str, dict | None]:
    """A text-level target's case (its server took or returned no token ids): rows must agree, then row 0's text
    against the oracle's completion as a server returns it (oracle `served_text`). Equal is `text_only`: weaker than
    a token comparison and never exact. Else the first differing character lies in one of the oracle's tokens
    (`served_text_ends`), and the margin rule of compare_case decides at that step."""
    if "served_text" not in oracle:
        raise HashMismatch(f"case {case['name']}: oracle/hf.json has no served_text (an older oracle); run it again")
    if not case["rows_identical"]:
        return "batch_row_mismatch", {"case": case["name"], "level": "text", **case["first_row_mismatch"]}
    want, got = oracle["served_text"], case["rows"][0]["text"]
    if want == got:
        return "text_only", None
    char = first_difference(want, got)
    step = next((i for i, end in enumerate(oracle["served_text_ends"]) if end > char), len(oracle["generated_ids"]))
    margin = token_at(oracle["margins"], step)
    div = {"case": case["name"], "row": 0, "level": "text", "char": char, "step": step,
           "oracle_text": want[char:char + 24], "target_text": got[char:char + 24],
           "oracle_token": token_at(oracle["generated_ids"], step), "oracle_margin": margin}
    if REPLACEMENT in want[:char + 1]:
        div["hint"] = UNDECODABLE_HINT
    return ("near_tie_divergence" if margin is not None and margin < near_tie else "engine_accuracy_gap"), div


def _position(oracle: dict, p: int) -> dict:
    """Where position p of the path is: the step of the generation it predicts (negative inside the prompt)."""
    return {"position": p, "step": p - (len(oracle["prompt_ids"]) - 1)}


def forced_rows(oracle: dict, case: dict, dtype: str, where: str) -> list[dict]:
    """Each row's errors against the float32 reference (logprobs.errors), from the case's forced run in dtype."""
    run = case.get("forced", {}).get(dtype)
    if run is None:
        raise HashMismatch(f"{where}: no teacher-forced run in {dtype}")
    try:
        return [logprobs.row_errors(oracle["reference"], row) for row in run["rows"]]
    except ValueError as e:
        raise HashMismatch(f"{where}: the {dtype} teacher-forced run does not follow the oracle's path: {e}") from e


def forced_row_mismatch(oracle: dict, case: dict, dtype: str, tol: float) -> dict | None:
    """Rows of a same-prompt batch along one forced path: the same top-1 and log-probs within tol of row 0's."""
    run = case["forced"][dtype]["rows"]
    first = torch.tensor(run[0]["ref_logprobs"], dtype=torch.float64)
    for r, row in enumerate(run[1:], 1):
        apart = (torch.tensor(row["ref_logprobs"], dtype=torch.float64) - first).abs().amax(-1)
        top1 = [a[0] == b[0] for a, b in zip(run[0]["top_ids"], row["top_ids"])]
        bad = [p for p in range(len(top1)) if not top1[p] or apart[p] > tol]
        if bad:
            p = bad[0]
            return {"case": case["name"], "row": r, "dtype": dtype, **_position(oracle, p), "forced": True,
                    "row0_token": run[0]["top_ids"][p][0], "row_token": row["top_ids"][p][0],
                    "max_abs_logprob_delta": float(apart[p]), "tolerance": tol}
    return None


def logic_check(oracle: dict, case: dict, rows: list[dict], tol: float) -> dict:
    """The float32 run's stats, and the first (position, row) whose |Δ| over the top-k exceeds tol."""
    out = {**logprobs.stats(rows), "tolerance": tol, "first_out": None}
    for p in range(len(oracle["reference"]["top_ids"])):
        for r, e in enumerate(rows):
            if float(e["delta"][p].max()) > tol:
                k = int(e["delta"][p].argmax())
                got = case["forced"][REFERENCE_DTYPE]["rows"][r]["ref_logprobs"][p][k]
                out["first_out"] = {"case": case["name"], "row": r, **_position(oracle, p),
                                    "token": oracle["reference"]["top_ids"][p][k],
                                    "oracle_logprob": oracle["reference"]["top_logprobs"][p][k],
                                    "engine_logprob": got, "abs_delta": float(e["delta"][p][k]), "tolerance": tol}
                return {**out, "pass": False}
    return {**out, "pass": True}


def check_forced(oracle: dict, case: dict, dtypes: list[str], rows: list[dict] | None, tol: float) -> tuple[
        str | None, dict | None, dict | None]:
    """One case's forced runs: (failing verdict or None, its detail, the logic check of the float32 rows' errors
    `rows`). Rows of the batch must agree in every dtype's run; then the float32 run must stay within tol (no
    float32 run, `rows` None: a target that gave none, no logic check)."""
    for d in dtypes:
        if (m := forced_row_mismatch(oracle, case, d, tol)) is not None:
            return "batch_row_mismatch", m, None
    if rows is None:
        return None, None, None
    logic = logic_check(oracle, case, rows, tol)
    return None if logic["pass"] else "engine_accuracy_gap", logic["first_out"], logic


def precision_check(oracle: dict, engine: dict[str, list[dict]], transformers: dict[str, dict], bound: float) -> dict:
    """The engine's error against the float32 reference in the campaign's dtype (per case, each row's), over
    transformers' own (per case)."""
    if oracle["dtype"] == REFERENCE_DTYPE:
        return {"applies": False, "reason": "a float32 campaign: the logic check is its precision check"}
    ratios = {name: _ratio(logprobs.stats(rows)["mean"], logprobs.stats([transformers[name]])["mean"])
              for name, rows in engine.items()}
    e = logprobs.stats([r for rows in engine.values() for r in rows])
    h = logprobs.stats([transformers[name] for name in engine])
    ratio = _ratio(e["mean"], h["mean"])
    return {"applies": True, "dtype": oracle["dtype"], "engine": e, "transformers": h, "ratio": ratio, "bound": bound,
            "case_ratios": ratios, "pass": ratio is not None and ratio <= bound}


def _ratio(a: float, b: float) -> float | None:
    """a / b; None (undefined, and failing) where transformers made no error and the engine did."""
    return a / b if b > 0 else (1.0 if a == 0 else None)


def kernels_of(run: dict) -> str:
    return run.get("kernels", "torch")


def label(run: dict) -> str:
    """As the run's file is named: parity/<label>.json (a target's: <name>-b<B>)."""
    if run.get("target"):
        return f"{run['backend']}-b{run['batch']}"
    return run_label(run["backend"], kernels_of(run), run["batch"])


def target_checks(run: dict, dtypes: list[str], campaign: str) -> tuple[list[str], dict[str, str]]:
    """A target's forced dtypes the checks can use (those every case has, of the campaign's and float32), and why
    each check that cannot run does not."""
    t, why = run["target"], {}
    if t["level"] == "text":
        return [], {"logic": "text level: no log-probs", "precision": "text level: no log-probs"}
    have = [d for d in dtypes if all(d in c.get("forced", {}) for c in run["cases"])]
    if not any(c.get("forced") for c in run["cases"]):
        gave = "its server echoes no prompt log-probs" if t["kind"] == "openai" else "its trace has no forced_rows"
        why = {"logic": f"no teacher-forced run ({gave})", "precision": f"no teacher-forced run ({gave})"}
    elif REFERENCE_DTYPE not in have:
        why["logic"] = f"its forced run is in {t['dtype']}, not float32"
    if campaign == REFERENCE_DTYPE:
        why.setdefault("precision", "a float32 campaign: the logic check is its precision check")
    elif campaign not in have:
        why.setdefault("precision", f"its forced run is in {t['dtype']}, not the campaign's {campaign}")
    return have, why


DESCRIBED = ("engine", "recipe", "version", "args", "weights_dtype", "kv_cache_dtype", "converted", "model")  # what ran


def cache_below(target: dict) -> bool:
    """The target declares a KV cache in a dtype that rounds more than the one it computes in."""
    cache = target.get("kv_cache_dtype")
    return cache is not None and NEAR_TIE[cache] > NEAR_TIE[target["dtype"]]


def pair_cells(runs: list[dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """Each variant pair's row 0, per batch size and case: ids token for token where both are token level, else the
    text each served."""
    by = {(r["backend"], r["batch"]): r for r in runs}
    out = []
    for a, b in pairs:
        for batch in sorted(n for name, n in by if name == a and (b, n) in by):
            run, other = by[(a, batch)], by[(b, batch)]
            token = run["target"]["level"] == other["target"]["level"] == "token"
            theirs = {c["name"]: c for c in other["cases"]}
            for case in run["cases"]:
                x, y = case["rows"][0], theirs[case["name"]]["rows"][0]
                x, y = (x["generated_ids"], y["generated_ids"]) if token else (x.get("served_text", x["text"]),
                                                                             y.get("served_text", y["text"]))
                at, div = first_difference(x, y), None
                if at is not None:
                    div = {"case": case["name"], "row": 0, "pair": [a, b], ("step" if token else "char"): at,
                           a: token_at(x, at) if token else x[at:at + 24], b: token_at(y, at) if token else y[at:at + 24]}
                out.append({"backend": f"{a} vs {b}", "kernels": "pair", "batch": batch, "case": case["name"],
                            "pair": [a, b], "level": "token" if token else "text", "first_divergence": div,
                            "verdict": "variant_mismatch" if div else "all_token_text_exact"})
    return out


def transport_cells(runs: list[dict]) -> list[dict]:
    """host-staged against collective, per kernels setting, batch size and case (row 0 of each)."""
    by = {(r["backend"], kernels_of(r), r["batch"]): {c["name"]: c for c in r["cases"]} for r in runs}
    out = []
    for (backend, kernels, batch), cases in sorted(by.items()):
        other = by.get((TRANSPORTS[1], kernels, batch))
        if backend != TRANSPORTS[0] or other is None:
            continue
        for name, case in cases.items():
            a, b = case["rows"][0]["generated_ids"], other[name]["rows"][0]["generated_ids"]
            step, div = first_difference(a, b), None
            if step is not None:
                div = {"case": name, "row": 0, "step": step,
                       "host_staged_token": token_at(a, step), "collective_token": token_at(b, step)}
            out.append({"backend": "host-staged vs collective", "kernels": kernels, "batch": batch, "case": name,
                        "verdict": "transport_regression" if div else "all_token_text_exact", "first_divergence": div})
    return out


def ragged_cells(runs: list[dict]) -> list[dict]:
    """The ragged batches (parity's float32 rows check): a row that parts from its prompt alone where both runs were
    sure beyond the logic tolerance is a `batch_row_mismatch`; within it a near tie, as rounding may part them."""
    verdicts = {replay.MISMATCH: "batch_row_mismatch", replay.NEAR_TIES: "near_tie_divergence",
                replay.AS_ALONE: "all_token_text_exact"}
    return [{"backend": run["backend"], "kernels": kernels_of(run), "batch": run["batch"], "case": "ragged",
             "verdict": verdicts[run["ragged"]["verdict"]], "first_divergence": run["ragged"]["largest"],
             "ragged": run["ragged"]} for run in runs]


def compare(oracle: dict, runs: list[dict], near_tie: float | None = None, logic_tolerance: float = LOGIC_TOLERANCE,
            precision_bound: float = PRECISION_BOUND, pairs: list[tuple[str, str]] | None = None) -> dict:
    """The comparison; near_tie: a fixed near-tie margin, or None for the dtype's, measured (logprobs.near_tie_margin);
    pairs: the variant pairs (targets.pairs)."""
    by_name = {c["name"]: c for c in oracle["cases"]}
    for c in oracle["cases"]:
        check_hashes(f"oracle case {c['name']}", c)
    dtypes = logprobs.dtypes(oracle["dtype"])
    transformers = logprobs.transformers_errors(oracle)
    margin, noise = logprobs.near_tie_margin(oracle["dtype"], transformers, near_tie)
    cells, forced = [], []
    for run in runs:
        names = sorted(c["name"] for c in run["cases"])
        if names != sorted(by_name):
            raise HashMismatch(f"{label(run)}: cases {names} differ from the oracle's {sorted(by_name)}")
        target = run.get("target")
        have, not_checked = target_checks(run, dtypes, oracle["dtype"]) if target else (dtypes, {})
        level = target["level"] if target else "token"
        logic, engine, start = [], {}, len(cells)
        for case in run["cases"]:
            o, where = by_name[case["name"]], f"{label(run)} case {case['name']}"
            for r, row in enumerate(case["rows"]):
                check_hashes(f"{where} row {r}", row)
            errs = {d: forced_rows(o, case, d, where) for d in have}  # present even where not decisive
            if oracle["dtype"] in errs:
                engine[case["name"]] = errs[oracle["dtype"]]
            verdict, div = text_case(o, case, margin) if level == "text" else compare_case(o, case, margin)
            free, checked = verdict, None
            if verdict != "batch_row_mismatch" and level == "token":  # the forced checks decide unless already worse
                bad, detail, checked = check_forced(o, case, have, errs.get(REFERENCE_DTYPE), logic_tolerance)
                logic += errs.get(REFERENCE_DTYPE, [])
                if bad == "engine_accuracy_gap" and target and cache_below(target):
                    bad, detail = "kv_cache_precision_gap", {**detail, "kv_cache_dtype": target["kv_cache_dtype"]}
                if bad is not None and worst_verdict((verdict, bad)) != verdict:  # strictly worse
                    verdict, div = bad, detail
            cells.append({"backend": run["backend"], "kernels": kernels_of(run), "batch": run["batch"], "case": case["name"],
                          "verdict": verdict, "free_running": free, "first_divergence": div, "logic": checked,
                          **({"target": run["backend"], "level": level} if target else {})})
        precision = (precision_check(oracle, engine, transformers, precision_bound) if "precision" not in not_checked
                     else {"applies": False, "reason": not_checked["precision"]})
        forced.append({"backend": run["backend"], "kernels": kernels_of(run), "batch": run["batch"],
                       "logic": {**logprobs.stats(logic), "tolerance": logic_tolerance} if logic else None,
                       "precision": precision,
                       **({"target": run["backend"], "level": level, "not_checked": not_checked} if target else {})})
        if precision.get("pass") is False:
            figures = {"cell": label(run), "dtype": oracle["dtype"], "engine_mean": precision["engine"]["mean"],
                       "transformers_mean": precision["transformers"]["mean"], "ratio": precision["ratio"],
                       "bound": precision_bound}
            # a decisive free-running divergence whose float32 run is right is the precision check's to name
            for c in cells[start:]:
                if c["verdict"] == "engine_accuracy_gap" and c["logic"] and c["logic"]["pass"]:
                    c["verdict"], c["first_divergence"] = "precision_regression", {**c["first_divergence"], **figures}
            cells.append({"backend": run["backend"], "kernels": kernels_of(run), "batch": run["batch"], "case": "all",
                          "verdict": "precision_regression", "first_divergence": figures})
    cells += transport_cells([r for r in runs if not r.get("target")])
    cells += ragged_cells([r for r in runs if r.get("ragged")])
    paired = pair_cells([r for r in runs if r.get("target")], pairs or [])
    cells += paired
    top = worst_verdict(c["verdict"] for c in cells)
    worst = next(c for c in cells if c["verdict"] == top)  # the first of the worst
    engines = {t["name"]: {**{k: t.get(k) for k in DESCRIBED}, "kind": t["kind"], "level": t["level"], "dtype": t["dtype"],
                           "verdict": worst_verdict(c["verdict"] for c in cells if c.get("target") == t["name"]),
                           "not_checked": next(f["not_checked"] for f in forced if f.get("target") == t["name"])}
               for t in {r["target"]["name"]: r["target"] for r in runs if r.get("target")}.values()}
    return {
        "verdict": worst["verdict"],
        "first_divergence": worst["first_divergence"],
        "near_tie_margin": margin,
        "near_tie_noise": noise,
        "logic_tolerance": logic_tolerance,
        "precision_bound": precision_bound,
        "cells": cells,
        "forced": forced,
        "targets": engines,
        "pairs": [{"a": a, "b": b, "verdict": worst_verdict(c["verdict"] for c in paired if c["pair"] == [a, b]),
                   "first_divergence": next((c["first_divergence"] for c in paired
                                             if c["pair"] == [a, b] and c["first_divergence"]), None)}
                  for a, b in pairs or []],
    }


def compare_parity(oracle: dict, runs: list[dict], config: dict) -> dict:
    """compare() under a campaign's config, as the stage runs it: a null near_tie_margin is measured."""
    parity = config["parity"]
    return compare(oracle, runs, parity.get("near_tie_margin"), parity["logic_tolerance"], parity["precision_bound"],
                   targets.pairs(config))


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help=f"the runs' files, {layout.parity_run('<run>-b<B>')}")
    args = ap.parse_args(argv)
    config = read_config(args.evidence / layout.CONFIG)
    parity = config["parity"]
    params = {"logic_tolerance": parity["logic_tolerance"], "precision_bound": parity["precision_bound"]}
    try:
        with Stage(args.evidence, "compare", params=params) as st:
            result = compare_parity(read_json(args.evidence / layout.ORACLE), [read_json(p) for p in args.runs], config)
            st.write_json(layout.COMPARISON, result)
            st.tags[gates.PARITY.tag] = result["verdict"]
            for name, t in result["targets"].items():  # each engine target's own, in MLflow too
                st.tags[f"parity.target.{name}"] = f"{t['verdict']} ({t['level']} level)"
            st.metrics["cells_exact"] = sum(c["verdict"] == "all_token_text_exact" for c in result["cells"])
            st.metrics["cells"] = len(result["cells"])
            st.params["near_tie_margin"] = result["near_tie_margin"]  # as configured, or measured
            logic = [f["logic"]["max"] for f in result["forced"] if f["logic"]]
            if logic:
                st.metrics["logic_max_abs_delta"] = max(logic)
            ratios = [f["precision"]["ratio"] for f in result["forced"] if f["precision"].get("ratio") is not None]
            if ratios:
                st.metrics["precision_ratio_max"] = max(ratios)
            print(f"[compare] verdict {result['verdict']} ({int(st.metrics['cells_exact'])}/{len(result['cells'])} cells exact)", flush=True)
    except HashMismatch as e:
        sys.exit(f"[compare] error: {e}")


if __name__ == "__main__":
    main()
