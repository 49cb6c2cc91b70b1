"""Small evidence directories built by hand, laid out the way the pipeline lays them out, in a
fraction of a second: the archive tests' cheap material (tests/test_pipeline.py builds real ones)."""

from __future__ import annotations

from pathlib import Path

import yaml

from evident.workflow.bench import benchstats
from evident.workflow.core.evidence import Stage, write_json, write_manifest, write_text
from evident.workflow.plan.runs import SAME, bench_cell, cell_label, cell_prompts

CONTRACT = {"prompt_sha256": "ab", "prompt_tokens": 9, "new_tokens": 5, "warmup": 1, "repeats": 3,
            "dtype": "float32", "timer": "perf_counter"}
VERSIONS = {"torch": "2.13.0+cpu", "transformers": "5.24.0"}
MODEL = {"model.safetensors": "cd" * 32}

SUMMARY = """## Evidence: `{campaign}` / `{eid}`

**Parity verdict: `{verdict}`** — the engine against the oracle, 1 case.

| what | value |
|---|---|
| commit | `{eid}` |
| device / dtype | cpu / float32 |

### Decode benchmark

| backend | batch | steady TPOT p50 (ms) | noisy |
|---|---|---|---|
| single | 1 | {tpot:.3f} | no |

![decode tok/s and TPOT against batch](plots/bench.png)

### Claim boundary

- Shows: parity for the listed case.
- Does not show: quality on trained weights.
"""


def cell(backend: str = "single", batch: int = 1, tpot: float = 10.0, spread: float = 0.0, **contract) -> dict:
    """One bench cell document; `spread` widens the per-repeat medians (0.1 makes the cell noisy)."""
    c = {**CONTRACT, **contract}
    steps = c["new_tokens"] - 2
    repeats = [{"ttft_ms": 20.0, "first_decode_ms": 12.0, "steady_ms": [tpot * (1 + spread * i)] * steps}
               for i in range(c["repeats"])]
    return {"backend": backend, "batch": batch, "contract": c, "versions": dict(VERSIONS), "model": dict(MODEL),
            "repeats": repeats, "stats": benchstats.summarize_cell(repeats, batch, c["new_tokens"])}


def http_cell(target: str = "engine", concurrency: int = 2, tpot: float = 5.0, ttft: float = 20.0, spread: float = 0.0,
              **contract) -> dict:
    """One cell of the benchmark over HTTP: every request's events `tpot` ms apart after `ttft` (a round i of them
    `tpot * (1 + spread * i)`), one event a token, each round ending 1 ms after its last event. Its prompt keys are
    CONTRACT's, so that it stands beside `cell()`."""
    c = {**CONTRACT, "prompts": SAME, "concurrency": concurrency, "timer": "perf_counter on the client", **contract}
    repeats = []
    for i in range(c["repeats"]):
        step = tpot * (1 + spread * i)
        chunks = [ttft + k * step for k in range(c["new_tokens"])]
        repeats.append({"duration_ms": chunks[-1] + 1.0, "requests": [
            {"chunk_ms": chunks, "output_tokens": c["new_tokens"], "counted_by": "usage"} for _ in range(concurrency)]})
    return {"target": target, "kind": "builtin" if target == "engine" else "openai", "concurrency": concurrency,
            "kernels": "torch", "contract": c, "versions": dict(VERSIONS), "model": dict(MODEL), "repeats": repeats,
            "stats": benchstats.summarize_http(repeats, concurrency, c["new_tokens"]), "refused": None}


def build(root: Path, campaign: str = "tiny", eid: str = "aaaaaaa-c11111111-r1", *, created: str = "2026-01-01T00:00:00Z",
          verdict: str = "all_token_text_exact", cells: list[dict] | None = None, tracking: dict | None = None,
          summary_extra: str = "", seal: bool = True, plot: bool = True, versions: dict | None = None,
          http_cells: list[dict] = ()) -> Path:
    """A sealed `root/campaign/eid/` with config, env, checkpoint, parity, bench (and `http_cells`, the engine's
    over HTTP), a plot, stage records and SUMMARY.md, then its manifest (unless `seal` is False)."""
    ev = root / campaign / eid
    cells = cells if cells is not None else [cell()]
    write_text(ev / "config.yaml", yaml.safe_dump({
        "campaign": campaign, "device": "cpu", "dtype": "float32", "repeat": 1,
        "bench": {"backends": sorted({c["backend"] for c in cells}), "new_tokens": cells[0]["contract"]["new_tokens"]}}))
    write_json(ev / "env.json", {"python": "3.11", "packages": {**VERSIONS, **(versions or {})}, "device": "cpu"})
    write_json(ev / "checkpoint.json", {"source": "synthetic", "files": {"model.safetensors": {"sha256": "cd" * 32, "size": 10}}})
    with Stage(ev, "compare") as st:
        st.write_json("parity/comparison.json", {"verdict": verdict, "near_tie_margin": 1e-4, "cells": [
            {"backend": "single", "kernels": "torch", "batch": 1, "case": "greeting", "verdict": verdict}]})
        st.tags["parity.verdict"] = verdict
        st.metrics.update(cells=1, cells_exact=float(verdict == "all_token_text_exact"))
    with Stage(ev, "bench-single") as st:
        for c in cells:
            st.write_json(f"bench/{bench_cell(c['backend'], c['batch'], cell_prompts(c))}.json", c)
            st.metrics[f"b{c['batch']}_tpot_p50_ms"] = c["stats"]["tpot"]["p50"]
    if http_cells:
        with Stage(ev, "serve_bench-engine") as st:
            for c in http_cells:
                st.write_json(f"bench/{cell_label(c)}.json", c)
    with Stage(ev, "bench_report") as st:
        frame = benchstats.summary_frame(cells)
        st.add_file(write_text(ev / "bench/summary.csv", frame.to_csv(index=False)))
        if plot:
            st.add_file(benchstats.plot(frame, ev / "plots/bench.png"))
    write_text(ev / "SUMMARY.md", SUMMARY.format(campaign=campaign, eid=eid, verdict=verdict,
                                                 tpot=cells[0]["stats"]["tpot"]["p50"]) + summary_extra)
    if seal:
        write_manifest(ev, {"evidence_id": eid, "campaign": campaign, "created_utc": created,
                            "git": {"commit": eid.split("-")[0] + "0" * 33, "dirty": None}, "config_sha256": "11" * 32,
                            "stages": {"compare": "ok", "bench-single": "ok", "bench_report": "ok"}, "verdict": verdict,
                            "tracking": tracking or {"status": "pending", "reason": "ConnectionError: unreachable"}})
    return ev
