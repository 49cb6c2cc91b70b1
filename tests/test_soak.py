"""The rate rung (serve_bench's cells of bench.http.rates) and the soak stage: the load client's maths on recorded
requests, the campaign check, and one campaign run (bench, serve_bench, soak; the tiny random-weight model on the
CPU) shared by the tests below it, with a defect a target (tests/soak_server.py): a slow server misses the SLO the
engine meets, a server that kills itself mid-soak is recorded as died, a leaking one is flagged as growth; the
engine passes; the campaign seals and the gate fails it on the soak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinyev
import yaml
from campaigns import overridden, rejected

from evident.workflow.bench import load
from evident.workflow.bench.benchstats import BenchError, request_metrics, summarize_rate
from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json
from evident.workflow.plan import targets
from evident.workflow.stages import soak

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
BASE = yaml.safe_load((REPO / "config/config.yaml").read_text())
# the tiny engine's TPOT on a CPU is a few ms (40 seen on a busy machine); the slow server's over 250
SLO = {"ttft_ms": 5000, "tpot_ms": 100}
SERVER = f"{{python}} {REPO / 'tests/soak_server.py'} --checkpoint {{checkpoint}} --port {{port}}"


# --- the maths, on recorded requests -----------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_and_every_rate_scales_the_same_draws():
    two, four = load.poisson_offsets(2, 7, n=200), load.poisson_offsets(4, 7, n=200)
    assert two[0] == 0.0 and two == load.poisson_offsets(2, 7, n=200) and two != load.poisson_offsets(2, 8, n=200)
    assert np.allclose(np.asarray(two) / 2, four)
    assert 0.4 < np.mean(np.diff(two)) < 0.6  # exponential gaps of mean 1 / rate
    timed = load.poisson_offsets(2, 7, duration_s=10)
    assert timed == two[:len(timed)] and timed[-1] < 10 <= two[len(timed)]


def test_tpot_counts_the_tokens_each_event_carried():
    """A server that coalesces: its first event carries 3 of 6 tokens. vLLM's TPOT spreads the time after it over 5
    tokens; with the event's count (continuous usage) over the 3 decoded after it."""
    assert request_metrics([10.0, 16.0, 22.0, 28.0], 6)["tpot_ms"] == 18.0 / 5
    assert request_metrics([10.0, 16.0, 22.0, 28.0], 6, [3, 1, 1, 1])["tpot_ms"] == 18.0 / 3
    assert request_metrics([10.0, 12.0, 14.0], 3, [1, 1, 1])["tpot_ms"] == 2.0  # an event a token: vLLM's figure
    with pytest.raises(BenchError, match="adding up to 6"):
        request_metrics([10.0, 16.0], 6, [3, 2])
    with pytest.raises(BenchError, match="did not stream"):
        request_metrics([10.0, 16.0], 6, [6, 0])


def request(ttft: float, tpot: float, tokens: int = 4, sent: float = 0.0) -> dict:
    return {"chunk_ms": [ttft + tpot * i for i in range(tokens)], "output_tokens": tokens, "counted_by": "usage",
            "sent_ms": sent}


def test_a_rate_cell_counts_failures_and_goodput_as_vllm_does():
    reqs = [request(10, 2), request(10, 30), request(900, 2), {"error": "ConnectionResetError: reset", "sent_ms": 5},
            request(10, 2, tokens=3)]
    s = summarize_rate(reqs, 2000.0, 4, {"ttft_ms": 100, "tpot_ms": 20})
    assert (s["requests"], s["completed"], s["failed"], s["good"]) == (5, 3, 2, 1)
    assert [f["request"] for f in s["failures"]] == [3, 4] and "3 output tokens" in s["failures"][1]["error"]
    assert (s["request_throughput"], s["output_tok_s"], s["goodput"]) == (1.5, 6.0, 0.5)  # over 2 s
    assert s["tpot"]["p50"] == 2.0 and s["ttft"]["count"] == 3 and s["itl"]["count"] == 9
    none = summarize_rate(reqs, 2000.0, 4, None)
    assert none["goodput"] is None and none["good"] is None
    dead = summarize_rate([{"error": "refused"}] * 2, 10.0, 4, {"ttft_ms": 1, "tpot_ms": 1})
    assert (dead["completed"], dead["goodput"], dead["tpot"]) == (0, 0.0, None)


def test_a_sweep_records_a_refused_server_as_errors_and_goes_on(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    ckpt, _ = tinyev.make(tmp_path, tinyev.config())
    closed = targets.Client(f"http://127.0.0.1:{targets.free_port()}/v1")  # nothing listens there
    monkeypatch.setattr(load, "PROGRESS_S", 0.0)  # a progress line at every request sent
    lines: list[str] = []
    done = load.sweep(closed, {"prompt": "x", "max_tokens": 4}, [0.0, 0.01, 0.02],
                      Tokenizer.from_file(str(ckpt / "tokenizer.json")), progress=lines.append)
    assert [line.split(": ")[1].split(",")[0] for line in lines] == [f"{i} of 3 requests sent" for i in (1, 2, 3)]
    assert len(done["requests"]) == 3 and done["unsent"] == 0
    assert all(r["error"].startswith("URLError") and r["sent_ms"] >= r["scheduled_ms"] for r in done["requests"])


def test_the_soak_rules_windows_and_growth():
    assert soak.windows(600)["first"] == [0.0, 60] and soak.windows(600)["last"] == [540.0, 600.0]
    short = soak.windows(60)
    assert short["first"] == [0.0, 20.0] and short["last"] == [40.0, 60.0] and "first and last third" in short["rule"]
    flat = [[t, 400.0 + (50.0 if t < 20 else 0.0)] for t in range(60)]  # warm-up grows, then flat: no flag
    assert soak.growth(flat, 60)["flagged"] is False and soak.growth(flat, 60)["growth_mb"] == 0.0
    leak = [[t, 400.0 + 2.0 * t] for t in range(60)]  # 2 MB a second
    g = soak.growth(leak, 60)
    assert g["flagged"] is True and g["growth_mb"] == 40.0
    small = [[t, 100.0 + 0.5 * t] for t in range(60)]  # +10% but 10 MB: allocator noise of a small server
    assert soak.growth(small, 60)["flagged"] is False
    assert soak.growth([[0.5, 400.0]], 60)["growth"] is None  # died in its first third: unknown, not flagged


def test_a_server_that_dies_before_it_is_ready_is_a_failed_soak_not_a_crash(tmp_path):
    """A misconfigured foreign engine: its serve command is cut short by `timeout` before the server answers."""
    ckpt, ev = tinyev.make(tmp_path, tinyev.config(soak={"duration_s": 1, "rate": 9, "seed": 0, "targets": None},
                                                   bench={"prompt": "Hello, evident!"}))
    spec = {"name": "cut", "kind": "openai",
            "serve": {"command": "timeout 0.5 {python} -m evident.engine.serve --checkpoint {checkpoint} --port {port}"}}
    soak.main(["--checkpoint", str(ckpt), "--evidence", str(ev), "--specs", json.dumps([spec])])
    record, gate = read_json(ev / layout.soak_record("cut")), read_json(ev / layout.SOAK_GATE)
    assert record["verdict"] == gate["verdict"] == "fail" and record["counts"]["sent"] == 0
    assert "exited with 124 before it was ready" in record["server"]["failed"] and "no soak ran" in gate["reason"]
    assert read_json(ev / "stages/soak.json")["status"] == "ok"  # the stage recorded it and ended as for any verdict


# --- the campaign check ------------------------------------------------------------------------------------------

COMMAND = f"{{python}} {REPO / 'tests/command_engine.py'} --checkpoint {{checkpoint}} {{request}} {{out}}"


@pytest.mark.parametrize("over, where, why", [
    ({"bench.http.slo": {"ttft_ms": 100, "tpot_ms": 10}}, "bench.http.slo", "give bench.http.rates"),
    ({"bench.http.slo": {"ttft_ms": 100}}, "bench.http.slo", "'tpot_ms' is a required property"),
    ({"bench.http.rates": [0]}, "bench.http.rates.0", "less than the minimum"),
    ({"bench.http.rates": [0.01], "bench.http.requests": 100}, "bench.http.rates", "beyond a job's wall time"),
    ({"bench.http.rates": [0.3333331, 0.3333332]}, "bench.http.rates", "two rates write one cell"),
    ({"stages": ["soak"], "soak.targets": ["mine"]}, "soak.targets.0", "a command target takes no HTTP requests"),
    ({"stages": ["soak"], "soak.targets": ["engin"]}, "soak.targets.0", "did you mean 'engine'"),
    ({"stages": ["soak"], "soak.rate": 0.1, "soak.duration_s": 30}, "soak", "need 9 at least"),
    ({"stages": ["soak"], "soak.duration_s": 7200}, "soak.duration_s", "beyond a job's wall time"),
])
def test_a_bad_rate_rung_or_soak_is_refused_naming_it(over, where, why):
    err = rejected(overridden(BASE, engines=[{"name": "mine", "kind": "command", "command": COMMAND}], **over))
    assert f"`{where}`" in err and why in err, err


# --- one campaign: the engine and a defect a target --------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(evidence dir, gate record, snakemake's result): bench, serve_bench (the engine and a slow server, two rates,
    an SLO) and a soak of 5 s at 6 requests/s (the engine, the engine's server at a url, a server that dies and one
    that leaks)."""
    tmp = tmp_path_factory.mktemp("soak")
    ckpt = tmp / "served-ckpt"  # the url target's server: the engine on a checkpoint of the same spec
    spec = tinyev.synthetic()
    from evident.workflow.models import checkpoints

    checkpoints.write_synthetic(ckpt, spec["config"], spec["seed"], spec["init_std"], "float32")
    with targets.engine_server(ckpt, "cpu", "float32", tmp / "served.log") as (url, _):
        cfg = {"campaign": "soak", "device": "cpu", "checkpoint": spec, "stages": ["bench", "serve_bench", "soak"],
               "bench": {"backends": ["single"], "batch_sizes": [1], "new_tokens": 4, "repeats": 1, "warmup": 0,
                         "http": {"concurrency": [1], "targets": ["engine", "slow"], "rates": [2, 4], "requests": 6,
                                  "slo": SLO}},
               "engines": [{"name": "slow", "kind": "openai", "serve": {"command": SERVER + " --token-delay-ms 250"}},
                           {"name": "remote", "kind": "openai", "url": url},
                           {"name": "dying", "kind": "openai", "serve": {"command": SERVER + " --die-after-s 1.5"}},
                           {"name": "leaky", "kind": "openai", "serve": {"command": SERVER + " --leak-mb 16"}}],
               "soak": {"duration_s": 5, "rate": 6, "targets": ["engine", "remote", "dying", "leaky"]},
               "tracking": {"enabled": False}}
        (tmp / "campaign.yaml").write_text(yaml.safe_dump(cfg))
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        r = subprocess.run([str(SNAKEMAKE), "-s", str(REPO / "Snakefile"), "-d", str(tmp / "wd"), "-c2",
                            "--configfile", str(tmp / "campaign.yaml")], capture_output=True, text=True, env=env,
                           timeout=900)
    assert (tmp / "wd/evidence/soak").is_dir(), r.stdout[-3000:] + r.stderr[-3000:]
    [ev] = [p for p in (tmp / "wd/evidence/soak").iterdir() if p.is_dir()]
    [gate] = (tmp / "wd/.evident/gates/soak").glob("*.json")
    return ev, read_json(gate), r


@pytest.mark.slow  # the campaign run: an end-to-end run, as tests/test_pipeline.py's
def test_the_campaign_seals_with_rate_cells_and_soak_records_and_the_gate_fails_on_the_soak(run):
    ev, gate, r = run
    assert (ev / layout.MANIFEST).is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    files = read_json(ev / layout.MANIFEST)["files"]
    for target in ("engine", "slow"):
        assert {layout.bench_cell(f"http-{target}-r{rate}") for rate in (2, 4)} | {layout.rate_plot(target)} <= set(files)
    assert {layout.soak_record(t) for t in ("engine", "remote", "dying", "leaky")} | {layout.SOAK_GATE} <= set(files)
    assert r.returncode != 0 and not gate["passed"] and gate["verdicts"]["soak"] == "fail"
    assert [why for why in gate["failed"] if why.startswith("the soak")], gate["failed"]
    doc = read_json(ev / layout.SOAK_GATE)
    assert {n: t["verdict"] for n, t in doc["targets"].items()} == {
        "engine": "pass", "remote": "pass", "dying": "fail", "leaky": "fail"}
    assert read_json(ev / "stages/soak.json")["tags"]["soak.verdict"] == "fail"


@pytest.mark.slow
def test_the_engine_meets_the_slo_a_slow_server_misses_it(run):
    ev = run[0]
    for rate in (2, 4):
        engine, slow = (read_json(ev / layout.bench_cell(f"http-{t}-r{rate}")) for t in ("engine", "slow"))
        s = engine["stats"]
        assert (s["completed"], s["failed"], s["good"]) == (6, 0, 6), s["failures"]
        assert s["goodput"] == 6 / s["duration_s"] and s["tpot"]["p50"] < SLO["tpot_ms"]
        assert engine["contract"]["arrivals"] == "poisson" and engine["contract"]["slo"] == SLO
        assert all("chunk_tokens" in q for q in engine["requests"])  # the engine counts each event's tokens
        t = slow["stats"]
        assert (t["completed"], t["good"], t["goodput"]) == (6, 0, 0.0) and t["tpot"]["p50"] > 250
        print(f"rate {rate}/s: engine goodput {s['goodput']:.2f}/s (TPOT p50 {s['tpot']['p50']:.2f} ms), "
              f"slow goodput {t['goodput']:.2f}/s (TPOT p50 {t['tpot']['p50']:.2f} ms)")
    # the engine's own requests under an SLO it cannot meet: none good
    impossible = summarize_rate(engine["requests"], engine["duration_ms"], 4, {"ttft_ms": 0.001, "tpot_ms": 0.001})
    assert impossible["good"] == 0 and impossible["goodput"] == 0.0 and impossible["completed"] == 6


@pytest.mark.slow
def test_the_engine_passes_the_soak_and_a_url_s_memory_is_unknown(run):
    ev = run[0]
    engine, remote = read_json(ev / layout.soak_record("engine")), read_json(ev / layout.soak_record("remote"))
    assert engine["verdict"] == "pass" and engine["counts"]["errors"] == 0 and not engine["server"]["died"]
    m = engine["memory"]
    assert m["known"] and not m["flagged"] and len(m["samples"]) >= 3 and m["samples"][0][1] > 0
    assert "first and last third" in engine["latency"]["rule"] and engine["latency"]["last_over_first"]["tpot"] > 0
    assert remote["verdict"] == "pass" and remote["memory"]["known"] is False and "unknown, not 0" in remote["memory"]["why"]
    print(f"engine soak: {soak.headline(engine)}; remote: {soak.headline(remote)}")


@pytest.mark.slow
def test_a_server_killed_mid_soak_is_recorded_as_died(run):
    ev = run[0]
    dying = read_json(ev / layout.soak_record("dying"))
    s = dying["server"]
    assert dying["verdict"] == "fail" and s["died"] and s["exit_code"] == -9 and 0 < s["at_s"] < 5, s
    assert isinstance(s["log_tail"], list) and dying["counts"]["unsent"] > 0
    assert any("the server died" in why for why in dying["reasons"])
    print(f"dying: {soak.headline(dying)}; {dying['reasons']}")


@pytest.mark.slow
def test_a_leaking_server_is_flagged_as_growth(run):
    ev = run[0]
    leaky = read_json(ev / layout.soak_record("leaky"))
    m = leaky["memory"]
    assert leaky["verdict"] == "fail" and m["flagged"] and m["growth_mb"] > soak.MEMORY_GROWTH_MB, m
    assert any("memory grew" in why for why in leaky["reasons"]) and leaky["counts"]["errors"] == 0
    print(f"leaky: {soak.headline(leaky)}")
