"""The bench_report stage: baseline lookup and per-cell claims against a baseline directory."""

from __future__ import annotations

import pytest

from evident.workflow.core.evidence import write_json
from evident.workflow.stages.bench_report import compare_to, resolve_baseline


def cell(backend="single", batch=1, tpot=10.0, new_tokens=5):
    repeats = [{"ttft_ms": 20.0, "first_decode_ms": 12.0, "steady_ms": [tpot] * (new_tokens - 2)} for _ in range(3)]
    from evident.workflow.bench.benchstats import summarize_cell

    return {"backend": backend, "batch": batch,
            "contract": {"prompt_sha256": "ab", "prompt_tokens": 9, "new_tokens": new_tokens, "warmup": 1,
                         "repeats": 3, "dtype": "float32", "timer": "perf_counter"},
            "versions": {"torch": "2.13.0"}, "model": {"model.safetensors": "cd"},
            "repeats": repeats, "stats": summarize_cell(repeats, batch, new_tokens)}


def sealed(root, name, cells):
    d = root / name
    for c in cells:
        write_json(d / "bench" / f"{c['backend']}-b{c['batch']}.json", c)
    (d / "MANIFEST.json").write_text("{}")
    return d


def test_baseline_by_id_prefix_and_errors(tmp_path):
    camp = tmp_path / "evidence" / "tiny"
    current = camp / "bbbbbbb-c1-r1"
    current.mkdir(parents=True)
    base = sealed(camp, "aaaaaaa-c1-r1", [cell()])
    assert resolve_baseline("aaaa", current) == base
    assert resolve_baseline(str(base), current) == base
    with pytest.raises(FileNotFoundError, match="no evidence directory"):
        resolve_baseline("zzz", current)
    sealed(camp, "aaaaaaa-c2-r1", [cell()])
    with pytest.raises(FileNotFoundError, match="2 directories"):
        resolve_baseline("aaaa", current)
    (camp / "ccccccc-c1-r1").mkdir()
    with pytest.raises(FileNotFoundError, match="not sealed"):
        resolve_baseline("ccc", current)


def test_claims_per_cell(tmp_path):
    base = sealed(tmp_path, "base", [cell(tpot=10.0), cell(batch=8, tpot=10.0)])
    faster = cell(tpot=8.0)
    changed = cell(batch=8, tpot=8.0)
    changed["contract"] = {**changed["contract"], "new_tokens": 6}
    missing = cell(backend="collective", tpot=8.0)
    out = {(c["backend"], c["batch"]): c for c in compare_to([faster, changed, missing], base)}
    assert out[("single", 1)]["claim"] == "faster"
    assert out[("single", 1)]["tpot_p50_change_pct"] == pytest.approx(-20.0)
    assert out[("single", 8)]["claim"] == "no directional claim" and "contract" in out[("single", 8)]["reason"]
    assert out[("collective", 1)]["claim"] == "no directional claim"
    assert "no collective-b1 cell" in out[("collective", 1)]["reason"]
