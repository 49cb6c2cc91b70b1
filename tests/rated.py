"""Hand-built records of issue 66, as serve_bench, soak and bench write them: cells of the rate rung
(bench/http-<target>-r<R>.json), soak records and the soak gate, an in-process cell's prefill floor. Their figures
come from the real summaries (benchstats.summarize_rate, soak.headline), so the reports read what a campaign
writes; tests/test_soak.py runs the stages themselves."""

from __future__ import annotations

from pathlib import Path

from handbuilt import MODEL, VERSIONS

from evident.workflow.bench import benchstats
from evident.workflow.core import layout
from evident.workflow.core.evidence import write_json, write_manifest
from evident.workflow.plan.runs import SAME, cell_label
from evident.workflow.stages import soak

SLO = {"ttft_ms": 100, "tpot_ms": 10}
NEW_TOKENS = 4
DURATION_MS = 3000.0


def rate_cell(target: str = "engine", rate: float = 2, tpot: float = 5.0, ttft: float = 20.0, n: int = 6,
              failed: int = 0, slo: dict | None = SLO, **contract) -> dict:
    """One rate of the rate rung: n requests (the last `failed` of them reset), each `ttft` then a token every
    `tpot` ms, over DURATION_MS."""
    c = {"prompts": SAME, "prompt_sha256": "ab", "prompt_tokens": 9, "new_tokens": NEW_TOKENS, "rate": rate,
         "requests": n, "arrivals": "poisson", "seed": 0, "slo": slo, "api": "/v1/completions, stream: true, greedy",
         "request_extras": ["stream_options"], "ignore_eos": "unverified", "timer": "perf_counter on the client",
         "dtype": "float32", "device": "cpu", **contract}
    reqs = [{"sent_ms": 300.0 * i, "chunk_ms": [ttft + tpot * k for k in range(NEW_TOKENS)],
             "output_tokens": NEW_TOKENS, "counted_by": "usage"} for i in range(n - failed)]
    reqs += [{"sent_ms": 0.0, "error": "ConnectionResetError: reset by peer"}] * failed
    return {"target": target, "kind": "builtin", "kernels": "torch", "dtype": "float32", "device": "cpu", "rate": rate,
            "contract": c, "requests": reqs, "duration_ms": DURATION_MS,
            "stats": benchstats.summarize_rate(reqs, DURATION_MS, NEW_TOKENS, c["slo"]),
            "server": {"ready_s": 1.0, "model": "evident-engine", "started": "here"},
            "versions": dict(VERSIONS), "model": dict(MODEL)}


def prefill_floor(ttft_ms: float, floor_ms: float) -> dict:
    """An in-process cell's `prefill_floor` (workflow/bench/floor.py's fields)."""
    return {"basis": "the prefill's bytes over the read bandwidth or its FLOPs over the matmul rate", "rows": 1,
            "prompt_tokens": 9, "ranks": 1,
            "unique_experts": {"mean": 3.0, "min": 2, "max": 4, "top_k": 2, "experts": 8, "moe_layers": 2},
            "bytes": {"weights": 400000, "chosen_experts": 100000, "embedding_rows": 1000, "cache": 9000,
                      "total": 510000},
            "flops": 2.0e7, "read_bandwidth_GBps": 20.0, "matmul_TFLOPs": 0.1, "bytes_ms": 0.0255,
            "flops_ms": floor_ms, "bound": "flops", "floor_ms": floor_ms, "ttft_p50_ms": ttft_ms,
            "ttft_over_floor": ttft_ms / floor_ms}


def soak_record(target: str = "engine", *, kind: str = "builtin", planned: int = 30, sent: int = 30, errors: int = 0,
                died_at: float | None = None, memory: dict | None = None, tpot: tuple = (5.0, 5.5)) -> dict:
    """A target's soak/<target>.json; `memory` None: a flat resident set; its reasons as the stage words them."""
    memory = memory or {"known": True, "what": "resident set of the server's process tree (MB)",
                        "samples": [[float(t), 400.0] for t in range(10)], "rule": soak.growth([], 1)["rule"],
                        "middle_mb": 400.0, "last_mb": 400.0, "growth_mb": 0.0, "growth": 0.0, "flagged": False}
    failures = [{"request": sent - 1 - i, "error": "URLError: connection refused"} for i in range(errors)]
    r = {"target": target, "kind": kind, "started": "url" if not memory["known"] else "here", "dtype": "float32",
         "device": "cpu",
         "contract": {"duration_s": 10.0, "rate": 3, "arrivals": "poisson", "seed": 0, "prompt_sha256": "ab",
                      "prompt_tokens": 9, "new_tokens": NEW_TOKENS, "request_extras": [], "ignore_eos": "unverified"},
         "counts": {"planned": planned, "sent": sent, "unsent": planned - sent, "errors": errors,
                    "error_samples": failures},
         "stats": rate_cell(target, n=sent, failed=errors, slo=None)["stats"],
         "latency": {"rule": "first and last third: the soak lasted 10 s, under 180 s has no two minutes apart",
                     "first": [0.0, 3.3], "last": [6.7, 10.0], "first_requests": 10, "last_requests": 10,
                     "first_p50_ms": {"ttft": 20.0, "tpot": tpot[0], "e2e": 40.0},
                     "last_p50_ms": {"ttft": 20.0, "tpot": tpot[1], "e2e": 40.0},
                     "last_over_first": {"ttft": 1.0, "tpot": tpot[1] / tpot[0], "e2e": 1.0}},
         "memory": memory,
         "server": {"died": died_at is not None, "failed": None}, "requests": []}
    if died_at is not None:
        r["server"].update(at_s=died_at, exit_code=-9, log_tail=["INFO: serving", "killed | by the test"])
        r["latency"]["last_p50_ms"] = r["latency"]["last_over_first"] = None
    reasons = []
    if errors:
        reasons.append(f"{target}: {errors} of {sent} requests failed (first: {failures[0]['error']})")
    if died_at is not None:
        reasons.append(f"{target}: the server died {died_at:.1f} s into the soak, exit code -9")
    if memory.get("flagged"):
        reasons.append(f"{target}: memory grew {memory['growth_mb']:+.1f} MB ({memory['growth']:+.1%}) from the middle "
                       "to the last third of the soak")
    r["verdict"], r["reasons"] = ("fail" if reasons else "pass"), reasons
    return r


URL_MEMORY = {"known": False, "why": "unknown, not 0: a url target: its server runs elsewhere"}


def soak_gate(records: list[dict]) -> dict:
    """soak/gate.json over the records, as the stage writes it."""
    reasons = [why for r in records for why in r["reasons"]]
    return {"verdict": "fail" if reasons else "pass", "verdict_reason": "; ".join(soak.headline(r) for r in records),
            "reason": "; ".join(reasons) or None,
            "targets": {r["target"]: {"verdict": r["verdict"], "reasons": r["reasons"]} for r in records},
            "rules": {"errors": "every request must complete its new_tokens, streamed", "memory": soak.growth([], 1)["rule"],
                      "drift": "recorded, not gated", "death": "the server's process must not exit during the soak"}}


def write(ev: Path, rates: list[dict] = (), soaks: list[dict] = ()) -> None:
    """The rate cells and the soak's records (and its gate) into an evidence directory."""
    for c in rates:
        write_json(ev / layout.bench_cell(cell_label(c)), c)
    for r in soaks:
        write_json(ev / layout.soak_record(r["target"]), r)
    if soaks:
        write_json(ev / layout.SOAK_GATE, soak_gate(list(soaks)))


def seal(ev: Path, created: str = "2026-01-01T00:00:00Z") -> Path:
    """Seal a directory handbuilt.build left unsealed, as it seals."""
    write_manifest(ev, {"evidence_id": ev.name, "campaign": ev.parent.name, "created_utc": created,
                        "git": {"commit": ev.name.split("-")[0] + "0" * 33, "dirty": None}, "config_sha256": "11" * 32,
                        "verdict": "all_token_text_exact", "tracking": {"status": "pending"}})
    return ev
