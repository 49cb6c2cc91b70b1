"""Unit tests for workflow/bench/benchstats.py on recorded, hand-built decode-benchmark samples.

Expected values are computed by hand in the comments (numpy's default linear percentile:
rank = (n - 1) * q, interpolate between the two neighbouring sorted samples)."""

from __future__ import annotations

import copy
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from evident.workflow.bench.benchstats import (
    MIN_EFFECT,
    NOISE,
    PROBE_LIMIT,
    UNPROBED_EFFECT,
    BenchError,
    contract_of,
    directional_claim,
    markdown_table,
    plot,
    stats,
    summarize_cell,
    summary_frame,
)

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def repeat(steady: list[float], ttft: float = 12.0, first: float = 5.0) -> dict:
    return {"ttft_ms": ttft, "first_decode_ms": first, "steady_ms": list(steady)}


def flat_repeats(medians: list[float], steps: int = 3) -> list[dict]:
    """One repeat per median, every steady interval equal to it (so its p50 is exactly that)."""
    return [repeat([m] * steps, ttft=10.0 + i, first=4.0 + i) for i, m in enumerate(medians)]


CONTRACT = {"prompt_sha256": "ab" * 32, "new_tokens": 5, "dtype": "bfloat16", "device": "H200"}
VERSIONS = {"torch": "2.13.0", "triton": "3.5.0", "engine": "abc1234"}
MODEL = {"model.safetensors": "cd" * 32, "config.json": "ef" * 32}


def cell(medians: list[float], backend: str = "collective", batch: int = 2, probe: float | None = None,
         **overrides) -> dict:
    """A cell of flat repeats; `probe` gives each repeat that machine probe (ms), None none (a cell from before it)."""
    repeats = [{**r, **({} if probe is None else {"probe_ms": probe})} for r in flat_repeats(medians)]
    doc = {
        "backend": backend,
        "batch": batch,
        "contract": copy.deepcopy(CONTRACT),
        "versions": copy.deepcopy(VERSIONS),
        "model": copy.deepcopy(MODEL),
        "stats": summarize_cell(repeats, batch=batch, new_tokens=5),
    }
    doc.update(overrides)
    return doc


# --- stats -----------------------------------------------------------------------------------

def test_stats_percentiles_on_known_list():
    # sorted 1..10: p50 rank 4.5 -> 5.5; p95 rank 8.55 -> 9.55; p99 rank 8.91 -> 9.91
    s = stats([7, 3, 10, 1, 5, 2, 9, 4, 8, 6])
    assert s["count"] == 10
    assert s["avg"] == pytest.approx(5.5)
    assert s["p50"] == pytest.approx(5.5)
    assert s["p95"] == pytest.approx(9.55)
    assert s["p99"] == pytest.approx(9.91)
    assert (s["min"], s["max"]) == (1.0, 10.0)


def test_stats_percentiles_uneven_gaps():
    # [2, 4, 8, 16, 32]: p50 rank 2 -> 8; p95 rank 3.8 -> 16 + 0.8*16 = 28.8; p99 rank 3.96 -> 31.36
    s = stats([32.0, 2.0, 16.0, 4.0, 8.0])
    assert s["p50"] == pytest.approx(8.0)
    assert s["p95"] == pytest.approx(28.8)
    assert s["p99"] == pytest.approx(31.36)
    assert s["avg"] == pytest.approx(12.4)
    assert set(s) == {"count", "avg", "p50", "p95", "p99", "max", "min"}


@pytest.mark.parametrize(
    "samples, match",
    [
        ([], "no samples"),
        ([3.0, 0.0, 4.0], r"sample 1 is 0\.0"),
        ([3.0, 4.0, -1.5], r"sample 2 is -1\.5"),
        ([float("nan"), 4.0], "not finite"),
        ([4.0, float("inf")], "not finite"),
        ([4.0, "fast"], "not numeric"),
    ],
)
def test_stats_rejects_unreal_samples(samples, match):
    with pytest.raises(BenchError, match=match):
        stats(samples)


# --- summarize_cell --------------------------------------------------------------------------

def test_decode_tok_s_hand_computed():
    # batch 4, 3 repeats x 3 steady steps = 9 steps -> 36 tokens; steady ms sum 6 + 6 + 8 = 20
    # -> 36 / 0.020 s = 1800 tok/s (not 4 * 1000 / mean, which happens to agree only here)
    reps = [repeat([1.0, 2.0, 3.0]), repeat([2.0, 2.0, 2.0]), repeat([3.0, 3.0, 2.0])]
    out = summarize_cell(reps, batch=4, new_tokens=5)
    assert out["decode_tok_s"] == pytest.approx(1800.0)
    assert out["tpot"]["count"] == 9
    assert out["tpot"]["p50"] == pytest.approx(2.0)
    assert out["repeat_tpot_p50"] == [2.0, 2.0, 3.0]
    assert out["spread"] == pytest.approx(0.5)  # (3 - 2) / median(2, 2, 3)
    assert out["noisy"] is True and "spread" in out["noise_reason"]
    assert out["ttft"]["count"] == 3 and out["first_decode"]["count"] == 3


def test_decode_tok_s_is_throughput_not_inverse_mean_tpot():
    # batch 1, steady [1, 3] (one repeat x 2 steps is invalid; use 3 repeats of 2 steps):
    # sum = 4 + 4 + 4 = 12 ms over 6 steps -> 500 tok/s
    reps = [repeat([1.0, 3.0]), repeat([3.0, 1.0]), repeat([2.0, 2.0])]
    out = summarize_cell(reps, batch=1, new_tokens=4)
    assert out["decode_tok_s"] == pytest.approx(500.0)


def test_ttft_and_first_decode_kept_apart_from_steady():
    reps = [repeat([2.0] * 3, ttft=100.0, first=9.0), repeat([2.0] * 3, ttft=110.0, first=11.0),
            repeat([2.0] * 3, ttft=120.0, first=10.0)]
    out = summarize_cell(reps, batch=1, new_tokens=5)
    assert out["ttft"]["p50"] == pytest.approx(110.0)
    assert out["first_decode"]["p50"] == pytest.approx(10.0)
    assert out["tpot"]["max"] == pytest.approx(2.0)


def test_wrong_steady_count_names_the_repeat():
    reps = [repeat([2.0, 2.0, 2.0]), repeat([2.0, 2.0]), repeat([2.0, 2.0, 2.0])]
    with pytest.raises(BenchError, match=r"repeat 1: 2 steady samples, expected 3"):
        summarize_cell(reps, batch=2, new_tokens=5)
    reps[1] = repeat([2.0] * 4)
    with pytest.raises(BenchError, match=r"repeat 1: 4 steady samples, expected 3"):
        summarize_cell(reps, batch=2, new_tokens=5)


@pytest.mark.parametrize(
    "bad, match",
    [
        (repeat([2.0, 0.0, 2.0]), r"repeat 2 steady_ms: sample 1 is 0\.0"),
        (repeat([2.0, float("nan"), 2.0]), r"repeat 2 steady_ms: .*not finite"),
        (repeat([2.0] * 3, ttft=0.0), r"repeat 2 ttft_ms"),
        (repeat([2.0] * 3, first=-1.0), r"repeat 2 first_decode_ms"),
        ({"ttft_ms": 1.0, "steady_ms": [2.0] * 3}, r"repeat 2: missing first_decode_ms"),
    ],
)
def test_bad_repeat_is_rejected_by_index(bad, match):
    reps = flat_repeats([2.0, 2.0]) + [bad]
    with pytest.raises(BenchError, match=match):
        summarize_cell(reps, batch=1, new_tokens=5)


def test_new_tokens_and_batch_validated():
    with pytest.raises(BenchError, match="new_tokens must be >= 3"):
        summarize_cell([repeat([])], batch=1, new_tokens=2)
    with pytest.raises(BenchError, match="batch"):
        summarize_cell(flat_repeats([2.0] * 3), batch=0, new_tokens=5)
    with pytest.raises(BenchError, match="no repeats"):
        summarize_cell([], batch=1, new_tokens=5)


def test_noisy_flag_just_below_and_just_above_threshold():
    assert NOISE == 0.05
    below = summarize_cell(flat_repeats([1.0, 1.0, 1.049], steps=1), batch=1, new_tokens=3)
    assert below["spread"] == pytest.approx(0.049)
    assert below["noisy"] is False and below["noise_reason"] is None
    above = summarize_cell(flat_repeats([1.0, 1.0, 1.051], steps=1), batch=1, new_tokens=3)
    assert above["spread"] == pytest.approx(0.051)
    assert above["noisy"] is True and "0.0510 > 0.05" in above["noise_reason"]


@pytest.mark.parametrize("n", [1, 2])
def test_fewer_than_three_repeats_flagged_noisy_with_reason(n):
    out = summarize_cell(flat_repeats([2.0] * n), batch=1, new_tokens=5)
    assert out["spread"] == pytest.approx(0.0)  # identical repeats: the spread alone would pass
    assert out["noisy"] is True
    assert f"only {n} repeat(s)" in out["noise_reason"]


# --- contract_of / directional_claim ---------------------------------------------------------

def test_contract_of_extracts_identity_and_rejects_malformed():
    c = cell([4.0, 4.0, 4.0])
    assert contract_of(c) == {"backend": "collective", "batch": 2, "contract": CONTRACT,
                              "versions": VERSIONS, "model": MODEL}
    broken = dict(c)
    del broken["versions"]
    with pytest.raises(BenchError, match="missing versions"):
        contract_of(broken)


def test_claim_faster_with_percentages():
    # baseline steady p50 4.0, spread 0.01; current p50 3.0 -> -25 %.
    # steady ms sums: baseline 3*(4 + 4 + 4.04) = 36.12, current 3*(3 + 3 + 3.03) = 27.09 = 0.75 * 36.12
    # -> tok/s ratio 4/3 -> +33.33 %
    base, cur = cell([4.0, 4.0, 4.04]), cell([3.0, 3.0, 3.03])
    out = directional_claim(cur, base)
    assert out["claim"] == "faster"
    assert out["tpot_p50_change_pct"] == pytest.approx(-25.0)
    assert out["tok_s_change_pct"] == pytest.approx(100.0 / 3.0)
    assert out["reason"] is None


def test_claim_slower_with_percentages():
    # current p50 5.0 vs 4.0 -> +25 %; sums 3*(5 + 5 + 5.05) = 1.25 * 36.12 -> tok/s -20 %
    out = directional_claim(cell([5.0, 5.0, 5.05]), cell([4.0, 4.0, 4.04]))
    assert out["claim"] == "slower"
    assert out["tpot_p50_change_pct"] == pytest.approx(25.0)
    assert out["tok_s_change_pct"] == pytest.approx(-20.0)
    assert out["reason"] is None


def test_difference_within_the_minimum_effect_makes_no_claim():
    # baseline spread (4.16 - 4.0) / 4.0 = 0.04 (not noisy); current spread 0; both probed alike. A quiet cell's
    # spread is at most NOISE, under MIN_EFFECT: between two directories the minimum effect is the bound.
    assert NOISE < MIN_EFFECT == 0.10
    base = cell([4.0, 4.0, 4.16], probe=3.0)
    assert base["stats"]["noisy"] is False and base["stats"]["spread"] == pytest.approx(0.04)
    within = directional_claim(cell([4.38] * 3, probe=3.0), base)  # +9.5 % <= 10 %
    assert within["claim"] == "no directional claim" and within["probe_ratio"] == pytest.approx(1.0)
    assert within["reason"] == ("difference within noise (|+9.50%| <= 10.00%: the larger spread 4.00%, the minimum "
                                "effect 10%)")
    assert within["tpot_p50_change_pct"] == pytest.approx(9.5)
    beyond = directional_claim(cell([4.42] * 3, probe=3.0), base)  # +10.5 % > 10 %
    assert beyond["claim"] == "slower" and beyond["reason"] is None
    assert beyond["tpot_p50_change_pct"] == pytest.approx(10.5)


def test_a_cell_without_probe_compares_conservatively():
    """A cell recorded before the probe existed: its machine is unchecked, so a claim needs UNPROBED_EFFECT, and the
    reason says which cell lacks the probe."""
    assert UNPROBED_EFFECT > MIN_EFFECT
    base = cell([4.0] * 3)
    out = directional_claim(cell([4.56] * 3, probe=3.0), base)  # +14 %: enough with probes, not without
    assert out["claim"] == "no directional claim" and out["probe_ratio"] is None
    assert out["reason"].startswith("difference within noise (|+14.00%| <= 15.00%")
    assert "minimum effect 15% as the baseline cell has no machine probe" in out["reason"]
    assert directional_claim(cell([4.56] * 3, probe=3.0), cell([4.0] * 3, probe=3.0))["claim"] == "slower"
    assert "the current and baseline cell" in directional_claim(cell([4.56] * 3), base)["reason"]
    assert directional_claim(cell([3.3] * 3), base)["claim"] == "faster"  # -17.5 %


def test_identical_code_on_a_loaded_machine_makes_no_claim():
    """The same commit run twice, the machine loaded for the second: every step slower by the load, and the probe
    with it. Each cell is quiet inside its run, yet the difference is the machine's: no claim, and the reason says
    so. A real slow-down on the same machine (probes alike) is still `slower`."""
    before = cell([2.0, 2.0, 2.02], probe=3.0)
    loaded = directional_claim(cell([2.7, 2.7, 2.72], probe=4.02), before)  # +35 % TPOT, probe 1.34x
    assert loaded["claim"] == "no directional claim"
    assert loaded["tpot_p50_change_pct"] == pytest.approx(35.0) and loaded["probe_ratio"] == pytest.approx(1.34)
    # 1.1 x 1.34 ** 2 = 1.975: the machine explains up to +97.5 %
    assert loaded["reason"] == ("difference within noise (|+35.00%| <= 97.52%: the larger spread 1.00%, the minimum "
                                "effect 10%, times what the machine differed by: (probe 1.34x slower in current) "
                                "** 2)")
    gone = directional_claim(cell([2.7, 2.7, 2.72], probe=4.8), before)  # probe 1.6x: beyond PROBE_LIMIT
    assert gone["claim"] == "no directional claim"
    assert gone["reason"] == ("machine differed: probe 1.60x slower in current (4.800 vs 3.000 ms, beyond 1.5x); load "
                              "or clocks changed between the runs")
    slowed = directional_claim(cell([2.7, 2.7, 2.72], probe=3.1), before)  # the code: 1.1 x 1.033 ** 2 = 1.17 < 1.35
    assert slowed["claim"] == "slower" and slowed["probe_ratio"] == pytest.approx(3.1 / 3.0)
    # a machine faster for the current cell explains no slow-down: +15 % is claimed against MIN_EFFECT alone
    assert directional_claim(cell([2.3, 2.3, 2.32], probe=2.4), before)["claim"] == "slower"
    quicker = directional_claim(before, cell([2.7, 2.7, 2.72], probe=4.02))  # the other way round: not faster
    assert quicker["claim"] == "no directional claim" and "(probe 1.34x faster in current) ** 2" in quicker["reason"]


@pytest.mark.parametrize("ratio, tpot, claim", [
    (PROBE_LIMIT - 0.001, 3.0, "faster"), (PROBE_LIMIT + 0.001, 3.0, None),  # the code faster on a slower machine
    (1 / (PROBE_LIMIT - 0.001), 5.0, "slower"), (1 / (PROBE_LIMIT + 0.001), 5.0, None),  # slower on a faster one
])
def test_probe_limit_both_ways(ratio, tpot, claim):
    out = directional_claim(cell([tpot] * 3, probe=2.0 * ratio), cell([4.0] * 3, probe=2.0))  # -25 % or +25 %
    assert out["claim"] == (claim or "no directional claim")
    assert claim or out["reason"].startswith("machine differed")


def test_probe_summarized_per_cell_and_failing_closed():
    reps = [{**r, "probe_ms": p} for r, p in zip(flat_repeats([2.0] * 3), [3.0, 5.0, 3.2])]
    out = summarize_cell(reps, batch=1, new_tokens=5)
    assert out["repeat_probe_ms"] == [3.0, 5.0, 3.2] and out["probe_ms"] == pytest.approx(3.2)  # the median
    assert "probe_ms" not in summarize_cell(flat_repeats([2.0] * 3), batch=1, new_tokens=5)
    with pytest.raises(BenchError, match="repeat 1: no probe_ms where other repeats have one"):
        summarize_cell([reps[0], flat_repeats([2.0])[0], reps[2]], batch=1, new_tokens=5)
    with pytest.raises(BenchError, match=r"probe_ms: sample 2 is 0\.0"):
        summarize_cell(reps[:2] + [{**reps[2], "probe_ms": 0.0}], batch=1, new_tokens=5)


def test_changed_contract_names_the_key():
    cur = cell([3.0, 3.0, 3.0])
    cur["contract"]["dtype"] = "float16"
    cur["contract"]["extra_flag"] = True
    out = directional_claim(cur, cell([4.0, 4.0, 4.0]))
    assert out["claim"] == "no directional claim"
    assert "contract differs (keys dtype, extra_flag)" in out["reason"]
    assert out["tpot_p50_change_pct"] is None and out["tok_s_change_pct"] is None


def test_changed_versions_blocks_claim():
    cur = cell([3.0, 3.0, 3.0])
    cur["versions"]["torch"] = "2.14.0"
    out = directional_claim(cur, cell([4.0, 4.0, 4.0]))
    assert out["claim"] == "no directional claim"
    assert "versions differ (torch)" in out["reason"]
    assert out["tpot_p50_change_pct"] is None


def test_changed_model_hash_blocks_claim():
    cur = cell([3.0, 3.0, 3.0])
    cur["model"]["model.safetensors"] = "00" * 32
    out = directional_claim(cur, cell([4.0, 4.0, 4.0]))
    assert out["claim"] == "no directional claim"
    assert "model differs" in out["reason"] and "model.safetensors" in out["reason"]


def test_different_backend_or_batch_blocks_claim():
    out = directional_claim(cell([3.0] * 3, backend="single"), cell([4.0] * 3, backend="collective"))
    assert out["claim"] == "no directional claim" and "backend differs" in out["reason"]
    out = directional_claim(cell([3.0] * 3, batch=4), cell([4.0] * 3, batch=2))
    assert out["claim"] == "no directional claim" and "batch differs" in out["reason"]


def test_noisy_current_blocks_claim():
    # only 2 repeats -> noisy, even though the difference is -25 %
    out = directional_claim(cell([3.0, 3.0]), cell([4.0, 4.0, 4.0]))
    assert out["claim"] == "no directional claim"
    assert "current cell noisy" in out["reason"] and "baseline" not in out["reason"]
    assert out["tpot_p50_change_pct"] == pytest.approx(-25.0)  # shown, but not claimed


def test_noisy_baseline_blocks_claim():
    out = directional_claim(cell([3.0, 3.0, 3.0]), cell([4.0, 4.0, 4.4]))  # spread 0.1
    assert out["claim"] == "no directional claim"
    assert "baseline cell noisy" in out["reason"] and "current" not in out["reason"]


def test_all_reasons_listed():
    cur = cell([3.0, 3.0])
    cur["contract"]["new_tokens"] = 9
    cur["versions"]["triton"] = "3.6.0"
    out = directional_claim(cur, cell([4.0, 4.0, 4.4]))
    for part in ("contract differs (keys new_tokens)", "versions differ (triton)",
                 "current cell noisy", "baseline cell noisy"):
        assert part in out["reason"]


# --- frame, markdown, plot -------------------------------------------------------------------

EXPECTED_COLUMNS = [
    "backend", "prompts", "batch", "ttft_p50_ms", "first_decode_p50_ms", "tpot_avg_ms", "tpot_p50_ms",
    "tpot_p95_ms", "tpot_p99_ms", "tpot_max_ms", "tpot_count", "decode_tok_s", "spread", "noisy",
    "first_warmup_over_repeat_s", "floor_ms", "floor_fraction", "floor_MB", "unique_experts_mean",
    "unique_experts_min", "unique_experts_max", "prefill_floor_ms", "ttft_over_prefill_floor",
]


def grid() -> list[dict]:
    """Cells deliberately out of order."""
    return [
        cell([4.0, 4.0, 4.0], backend="single", batch=4),
        cell([3.0, 3.0, 3.0], backend="collective", batch=2),
        cell([2.0, 2.0, 2.0], backend="single", batch=1),
        cell([5.0, 5.0, 5.5], backend="host-staged", batch=8),
        cell([2.5, 2.5, 2.5], backend="collective", batch=1),
        cell([3.5, 3.5, 3.5], backend="host-staged", batch=1),
    ]


def test_summary_frame_columns_and_sorting():
    frame = summary_frame(grid())
    assert list(frame.columns) == EXPECTED_COLUMNS
    assert list(zip(frame["backend"], frame["batch"])) == [
        ("collective", 1), ("collective", 2), ("host-staged", 1), ("host-staged", 8),
        ("single", 1), ("single", 4),
    ]
    row = frame.iloc[1]  # collective b2: flat 3.0 ms, 9 steps x batch 2 / 27 ms
    assert row["tpot_p50_ms"] == pytest.approx(3.0)
    assert row["tpot_count"] == 9
    assert row["decode_tok_s"] == pytest.approx(2 * 9 / 0.027)
    assert row["ttft_p50_ms"] == pytest.approx(11.0) and row["first_decode_p50_ms"] == pytest.approx(5.0)
    assert frame.loc[frame["backend"] == "host-staged", "noisy"].tolist() == [False, True]
    csv = frame.to_csv(index=False)
    assert csv.splitlines()[0] == ",".join(EXPECTED_COLUMNS)
    assert len(csv.splitlines()) == 7


def test_summary_frame_rejects_empty_and_duplicates():
    with pytest.raises(BenchError, match="no cells"):
        summary_frame([])
    with pytest.raises(BenchError, match="duplicate cell backend=single prompts=same-prompt batch=4"):
        summary_frame(grid() + [cell([1.0] * 3, backend="single", batch=4)])


def distinct(c: dict, floor_ms: float | None = None) -> dict:
    """c as a distinct-prompts cell (its contract names it), with a floor record where floor_ms is given."""
    c = {**c, "contract": {**c["contract"], "prompts": "distinct-prompts"}}
    if floor_ms is not None:
        c["floor"] = {"floor_ms": floor_ms, "floor_fraction": floor_ms / c["stats"]["tpot"]["p50"],
                      "bytes": {"total": 5e6}, "unique_experts": {"mean": 5.5, "min": 4, "max": 7}}
        c["prefill_floor"] = {"floor_ms": floor_ms / 2, "ttft_over_floor": c["stats"]["ttft"]["p50"] / (floor_ms / 2)}
    return c


def test_the_two_prompt_contracts_are_two_rows_with_their_floors():
    """A same-prompt and a distinct-prompts cell of one backend and batch: two rows (same-prompt first), each with
    its contract and its own floor; the table says which contract each figure is and puts the floor beside it."""
    frame = summary_frame([distinct(cell([4.0] * 3, backend="single", batch=4), floor_ms=2.0),
                           cell([3.0] * 3, backend="single", batch=4)])
    assert list(zip(frame["prompts"], frame["tpot_p50_ms"])) == [("same-prompt", 3.0), ("distinct-prompts", 4.0)]
    assert frame["floor_fraction"].tolist()[1] == pytest.approx(0.5) and frame["floor_ms"].isna().tolist()[0]
    # the prefill's floor beside the cell's TTFT: 11 ms over 1 ms; none for the cell without one
    assert frame["prefill_floor_ms"].tolist()[1] == 1.0 and frame["ttft_over_prefill_floor"].tolist()[1] == 11.0
    assert frame[["prefill_floor_ms", "ttft_over_prefill_floor"]].iloc[0].isna().all()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in markdown_table(frame).strip().splitlines()]
    assert rows[2] == ["single", "same", "4", "3.000", "3.000", "3.000", "1333.3", "—", "—", "—", "no"]
    assert rows[3][:3] == ["single", "distinct", "4"] and rows[3][7:] == ["2.000", "50%", "5.5 (4–7)", "no"]
    with pytest.raises(BenchError, match="duplicate cell backend=single prompts=distinct-prompts batch=4"):
        summary_frame([distinct(cell([4.0] * 3, backend="single", batch=4))] * 2)


def test_markdown_table_header_and_rows():
    frame = summary_frame(grid())
    lines = markdown_table(frame).strip().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["backend", "prompts", "batch", "steady TPOT p50 (ms)", "TPOT avg (ms)", "p95", "decode tok/s",
                        "floor (ms)", "floor / TPOT p50", "unique experts a MoE layer", "noisy"]
    assert set(lines[1]) <= set("|-: ") and lines[1].count("|") == 12
    assert len(lines) == 2 + len(frame)
    assert cells[3] == ["collective", "same", "2", "3.000", "3.000", "3.000", "666.7", "—", "—", "—", "no"]
    assert cells[5][-1] == "yes"  # host-staged b8: spread 0.1


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_deterministic_png(tmp_path):
    frame = summary_frame(grid())
    a, b = tmp_path / "a" / "decode.png", tmp_path / "b.png"
    assert plot(frame, a) == a
    plot(frame, b)
    data = a.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert _png_size(data) == (1200, 480)  # 10 x 4 in at 120 dpi
    assert data == b.read_bytes()
    assert b"Software" not in data and b"matplotlib" not in data.lower()
    assert not list(tmp_path.rglob("*.tmp"))  # written atomically, no leftovers


def test_plot_bytes_identical_in_fresh_process(tmp_path):
    frame = summary_frame(grid())
    here = tmp_path / "here.png"
    plot(frame, here)
    frame.to_pickle(tmp_path / "frame.pkl")
    there = tmp_path / "there.png"
    code = (
        "import pandas as pd, sys; from evident.workflow.bench.benchstats import plot; "
        "plot(pd.read_pickle(sys.argv[1]), sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "frame.pkl"), str(there)],
                   cwd=ROOT, check=True, timeout=60)
    assert here.read_bytes() == there.read_bytes()


def test_plot_rejects_empty_frame(tmp_path):
    frame = summary_frame(grid()).iloc[0:0]
    with pytest.raises(BenchError, match="nothing to plot"):
        plot(frame, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_rings_noisy_cells(tmp_path):
    """host-staged b8 is noisy (spread 0.1): its points are ringed, so the PNG differs from the same frame unflagged."""
    frame = summary_frame(grid())
    assert frame["noisy"].sum() == 1
    plot(frame, tmp_path / "marked.png")
    plot(frame.assign(noisy=False), tmp_path / "quiet.png")
    assert (tmp_path / "marked.png").read_bytes() != (tmp_path / "quiet.png").read_bytes()


def test_probes_of_different_workloads_make_no_claim():
    before, after = cell([2.0, 2.0, 2.02], probe=3.0), cell([2.7, 2.7, 2.72], probe=3.0)  # +35 %, probes alike
    before["probe"], after["probe"] = {"rounds": 64}, {"rounds": 32}  # the cells' workloads (workflow/bench/machine.py)
    out = directional_claim(after, before)
    assert out["claim"] == "no directional claim" and "different workloads" in out["reason"]
    after["probe"] = {"rounds": 64}
    assert directional_claim(after, before)["claim"] == "slower"
