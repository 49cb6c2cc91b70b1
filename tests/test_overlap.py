"""The overlap A/B screen stage (workflow/stages/overlap.py, the experiment in kernels/overlap.py): where the
shapes come from (the model, the campaign, or none: skipped), bitwise A = B on fresh inputs, the verdict rule, a
broken variant B failing the gate after sealing, the SUMMARY section, and (on a GPU) the timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from evident.workflow.archive import summary
from evident.workflow.bench.benchstats import BenchError
from evident.workflow.core.evidence import read_json, write_manifest
from evident.workflow.stages import gate
from evident.workflow.stages import overlap as ov

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
C4 = {"K": 4096, "segments": [2048, 512, 64], "gemm_n": 1536}  # the DeepSeek-V4 C4 shapes, as the GPU campaigns state


SCHEMA = yaml.safe_load((REPO / "config/schema.yaml").read_text())["properties"]


def overlap_defaults() -> dict:
    return {k: v["default"] for k, v in SCHEMA["overlap"]["properties"].items()}


def write_config(ev: Path, device: str, screens: list[dict] = (), **overlap) -> dict:
    """The default campaign's config with the device, `screens` (tests/test_screens.py) and `overlap` keys
    overridden over the schema's `overlap` defaults (read from the schema, not validated: snakemake need not be
    installed here)."""
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg.setdefault("stages", SCHEMA["stages"]["default"])  # read by the gate
    cfg["device"] = device
    cfg["overlap"] = {**overlap_defaults(), **overlap}
    cfg["screens"] = list(screens)
    ev.mkdir(parents=True, exist_ok=True)
    (ev / "config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


def seal_and_gate(ev: Path, out: Path) -> str:
    """The overlap verdict the gate recorded (it exits when it fails the run)."""
    write_manifest(ev, {"evidence_id": ev.name, "verdict": "all_token_text_exact"})
    gate.main(["--evidence", str(ev), "--out", str(out)])
    return read_json(out)["verdicts"]["overlap"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The stage as the rule runs it, on the CPU, in a fresh process (the interpreter switch is read when
    Triton decorates the kernels, so an in-process run could inherit compiled ones on a GPU machine)."""
    ev = tmp_path_factory.mktemp("cpu") / "ev"
    cfg = write_config(ev, "cpu", inputs=16, **C4)
    assert cfg["overlap"]["trials"] == 200  # a schema default
    # the interpreter, as the rule sets it for a CPU campaign: a GPU machine's environment has no TRITON_INTERPRET
    proc = subprocess.run([sys.executable, "-m", "evident.workflow.stages.overlap", "--evidence", str(ev)],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return ev, proc.stdout


def test_cpu_stage_bitwise_equal_and_timing_not_measured(cpu_run):
    ev, stdout = cpu_run
    s = read_json(ev / "overlap/screen.json")
    assert s["device"] == "cpu" and s["shapes"]["source"] == "cpu-small"
    assert s["shapes"]["reason"] == ov.CPU_REASON and s["shapes"]["configured"] == {"source": "campaign", **C4}
    assert s["shapes"]["segments"] == [32, 16, 8] and s["skipped"] is None
    assert s["shapes"]["segment_dtypes"] == ["float32", "float32", "float16"]
    bw = s["bitwise"]
    assert bw["inputs"] == 16 and bw["all_outputs_equal"] == 16 and bw["mismatched_inputs"] == []
    assert bw["per_output_equal"] == {"segment0": 16, "segment1": 16, "segment2": 16, "gemm": 16}
    assert bw["graph_equal_eager"] is None and "no CUDA graphs" in bw["graph_equal_eager_reason"]
    assert s["timing"] == {"measured": False, "reason": ov.CPU_REASON, "envelopes": None}
    assert s["verdict"] == "not_measured" and s["verdict_reason"] == ov.CPU_REASON
    assert (ev / "overlap/timings.csv").read_text() == ov.CSV_HEADER
    assert (ev / "plots/overlap.png").read_bytes().startswith(PNG)
    rec = read_json(ev / "stages/overlap.json")
    assert rec["status"] == "ok" and rec["tags"] == {"overlap.verdict": "not_measured"}
    assert rec["metrics"] == {"bitwise_inputs": 16, "bitwise_equal": 16}
    assert rec["files"] == ["overlap/screen.json", "overlap/timings.csv", "plots/overlap.png"]
    assert "[overlap] bitwise 16/16: 16 equal" in stdout


def test_gate_passes_an_equal_screen(cpu_run, tmp_path):
    ev, _ = cpu_run
    assert seal_and_gate(ev, tmp_path / "gate.json") == "not_measured"


# --- the verdict rule ------------------------------------------------------------------------

def samples(median: float, n: int = 40, jitter: float = 0.002) -> list[float]:
    rng = np.random.default_rng(int(median * 10))
    return (median * (1 + jitter * rng.standard_normal(n))).tolist()


def envelope(a_us: list[float], b_us: list[float]) -> dict:
    a, b = ov.variant_stats(a_us), ov.variant_stats(b_us)
    return {"A": a, "B": b, **ov.envelope_claim(a, b)}


def test_claim_only_beyond_the_noise():
    faster = envelope(samples(100.0), samples(50.0))
    assert faster["claim"] == "B faster" and faster["reason"] is None
    assert faster["ratio_b_over_a"] == pytest.approx(0.5, rel=0.01) and faster["change_pct"] < -45
    within = envelope(samples(100.0), samples(97.0))  # 3% < NOISE (5%)
    assert within["claim"] == "no directional claim" and "within noise" in within["reason"]
    assert within["change_pct"] == pytest.approx(-3.0, abs=0.3)
    slower = envelope(samples(100.0), samples(120.0))
    assert slower["claim"] == "B slower"
    # A noisy variant (block medians 100 .. 140) makes no claim, however large the difference.
    noisy_a = [m for m in (100.0, 110.0, 120.0, 130.0, 140.0) for _ in range(8)]
    noisy = envelope(noisy_a, samples(50.0))
    assert noisy["A"]["noisy"] and noisy["claim"] == "no directional claim" and "A noisy" in noisy["reason"]
    few = envelope([100.0, 100.0], [50.0, 50.0])  # two trials: two blocks, too few to measure noise
    assert few["claim"] == "no directional claim" and "only 2 block(s)" in few["reason"]
    with pytest.raises(BenchError):
        ov.variant_stats([10.0, 0.0, 10.0])  # a zero duration: the timer did not cover the work


def test_overall_verdict():
    fast, slow = envelope(samples(100.0), samples(50.0)), envelope(samples(100.0), samples(120.0))
    flat = envelope(samples(100.0), samples(99.0))
    assert ov.overall_verdict(64, 64, {"warm": fast, "scrubbed": fast})[0] == "b_faster"
    assert ov.overall_verdict(64, 64, {"warm": slow, "scrubbed": slow})[0] == "b_slower"
    verdict, reason = ov.overall_verdict(64, 64, {"warm": fast, "scrubbed": flat})
    assert verdict == "no_claim" and "warm: B faster" in reason and "scrubbed: no directional claim" in reason
    assert ov.overall_verdict(64, 64, {"warm": fast, "scrubbed": slow})[0] == "no_claim"
    assert ov.overall_verdict(64, 63, {"warm": fast, "scrubbed": fast}) == (
        "bitwise_mismatch", "1 of 64 input sets gave outputs of A and B that differ")
    assert ov.overall_verdict(64, 64, None, ov.CPU_REASON) == ("not_measured", ov.CPU_REASON)


# --- where the shapes come from ------------------------------------------------------------------

def overlap_config(model: dict, **overlap) -> dict:
    return {"checkpoint": {"config": model}, "overlap": {**overlap_defaults(), **overlap}}


def test_model_shapes_are_transformers_deepseek_v4_c4_projections():
    """model_shapes against the modules transformers builds for a C4 (compressed sparse attention) layer."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    cfg = transformers.DeepseekV4Config()  # V4-Flash's defaults
    with torch.device("meta"):
        attn = modeling.DeepseekV4Attention(cfg, cfg.layer_types.index("compressed_sparse_attention"))
    lin = {n: m for n, m in attn.named_modules() if isinstance(m, torch.nn.Linear)}
    names = [["compressor.kv_proj", "compressor.gate_proj"], ["compressor.indexer.kv_proj", "compressor.indexer.gate_proj"],
             ["compressor.indexer.scorer.weights_proj"], ["q_a_proj", "kv_proj"]]
    assert {lin[n].in_features for group in names for n in group} == {cfg.hidden_size}
    *aux, main = [sum(lin[n].out_features for n in group) for group in names]
    assert ov.model_shapes(cfg.to_dict()) == {"K": cfg.hidden_size, "segments": aux, "gemm_n": main} == C4


def test_shapes_from_the_model_else_the_campaign_else_none():
    v2 = yaml.safe_load((REPO / "config/config.yaml").read_text())["checkpoint"]["config"]
    assert ov.model_shapes(v2) is None  # DeepSeek-V2: no compressor, no screened projections
    assert ov.shapes_of(overlap_config(v2), cuda=True) is None  # and no stated shapes: skipped
    stated = ov.shapes_of(overlap_config(v2, K=1024, segments=[64, 32], segment_dtypes=["float32", "float16"],
                                         gemm_n=96), cuda=True)
    assert stated == {"source": "campaign", "K": 1024, "segments": [64, 32], "gemm_n": 96, "reason": None,
                      "joined_n": 96, "segment_dtypes": ["float32", "float16"], "dtype": "float16"}
    cpu = ov.shapes_of(overlap_config(v2, **C4), cuda=False)
    assert cpu["source"] == "cpu-small" and cpu["K"] == ov.CPU_SHAPES["K"] and cpu["segments"] == [32, 16, 8]
    assert cpu["configured"] == {"source": "campaign", **C4} and cpu["reason"] == ov.CPU_REASON
    v4 = {**v2, "hidden_size": 2048, "compress_ratios": [0, 4, 128], "head_dim": 128, "index_head_dim": 32,
          "index_n_heads": 16, "q_lora_rank": 256}
    assert ov.shapes_of(overlap_config(v4), cuda=True) == {
        "source": "model", "K": 2048, "segments": [512, 128, 16], "gemm_n": 384, "reason": None, "joined_n": 656,
        "segment_dtypes": ["float32", "float32", "float16"], "dtype": "float16"}
    with pytest.raises(ValueError, match="leave overlap.K, overlap.segments, overlap.gemm_n null"):
        ov.shapes_of(overlap_config(v4, **C4), cuda=True)  # the model's shapes are the only ones
    with pytest.raises(ValueError, match="together or not at all .this campaign states only K, gemm_n"):
        ov.shapes_of(overlap_config(v2, K=4096, gemm_n=1536), cuda=True)
    with pytest.raises(ValueError, match="but not index_n_heads"):
        ov.model_shapes({k: v for k, v in v4.items() if k != "index_n_heads"})
    with pytest.raises(ValueError, match="differ in length"):
        ov.shapes_of(overlap_config(v2, K=64, segments=[8, 8], gemm_n=8), cuda=True)


def test_the_kernels_campaign_states_the_c4_shapes():
    kernels = yaml.safe_load((REPO / "config/campaigns/dsv2-lite-kernels.yaml").read_text())
    assert {k: kernels["overlap"][k] for k in C4} == C4


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory):
    """The default campaign (the tiny DeepSeek-V2, no overlap shapes): nothing to screen. In process: the
    skipped stage imports no kernel."""
    ev = tmp_path_factory.mktemp("skipped") / "ev"
    write_config(ev, "cpu")
    return ev, ov.run(ev)


def test_no_shapes_skips_the_screen_with_the_reason(skipped_run, tmp_path):
    ev, s = skipped_run
    assert s["skipped"] == ov.SKIP_REASON and s["shapes"] is None and s["bitwise"] is None
    assert s["verdict"] == "not_measured" and s["verdict_reason"] == ov.SKIP_REASON
    assert s["timing"] == {"measured": False, "reason": ov.SKIP_REASON, "envelopes": None}
    assert read_json(ev / "overlap/screen.json") == json.loads(json.dumps(s))
    assert (ev / "overlap/timings.csv").read_text() == ov.CSV_HEADER
    assert (ev / "plots/overlap.png").read_bytes().startswith(PNG)
    rec = read_json(ev / "stages/overlap.json")
    assert rec["status"] == "skipped" and rec["reason"] == ov.SKIP_REASON  # never ok: nothing was screened
    assert rec["metrics"] == {} and rec["tags"] == {"overlap.verdict": "not_measured"}
    assert rec["files"] == ["overlap/screen.json", "overlap/timings.csv", "plots/overlap.png"]
    text = "\n".join(summary.overlap_section(ev))
    assert "### Overlap A/B screen (skipped)" in text and f"**Verdict: `not_measured`** — {ov.SKIP_REASON}." in text
    assert "![" not in text  # the stage's plot is a panel of that text: no image of it
    assert seal_and_gate(ev, tmp_path / "gate.json") == "not_measured"  # a screen that did not apply fails nothing


# --- a broken B --------------------------------------------------------------------------------

def test_broken_b_is_a_bitwise_mismatch_and_the_gate_fails(tmp_path, monkeypatch):
    """B's fused GEMV perturbs one element of segment 1: every input set mismatches there only; the stage
    still succeeds (the evidence is written), and the gate fails after sealing. `auto`: the CPU path
    here, the CUDA graphs on a GPU machine."""
    import evident.kernels.gemv as gemv

    real = gemv.gemv_fused

    def broken(*args, **kwargs):
        outs = real(*args, **kwargs)
        outs[1][3] += 1  # one element of one segment (capturable in a CUDA graph)
        return outs

    monkeypatch.setattr(gemv, "gemv_fused", broken)
    ev = tmp_path / "ev"
    write_config(ev, "auto", inputs=3, trials=4, warmup=1, **C4)
    s = ov.run(ev)
    bw = s["bitwise"]
    assert s["verdict"] == "bitwise_mismatch" and s["verdict_reason"].startswith("3 of 3 input sets")
    assert bw["all_outputs_equal"] == 0 and bw["mismatched_inputs"] == [0, 1, 2]
    assert bw["per_output_equal"] == {"segment0": 3, "segment1": 0, "segment2": 3, "gemm": 3}
    assert bw["first_mismatch"]["input"] == 0
    diff = bw["first_mismatch"]["outputs"]
    assert list(diff) == ["segment1"] and diff["segment1"]["elements_differ"] == 1
    assert diff["segment1"]["max_abs_diff"] == pytest.approx(1.0, abs=1e-5)
    if torch.cuda.is_available():
        assert bw["graph_equal_eager"] == 3  # A itself is intact
    rec = read_json(ev / "stages/overlap.json")
    assert rec["status"] == "ok" and rec["tags"]["overlap.verdict"] == "bitwise_mismatch"
    assert rec["metrics"]["bitwise_equal"] == 0
    with pytest.raises(SystemExit, match="overlap A/B screen.*A and B differ"):
        seal_and_gate(ev, tmp_path / "gate.json")
    gate_record = read_json(tmp_path / "gate.json")  # a failing run's record too, with why it failed
    assert gate_record["passed"] is False and gate_record["verdicts"]["overlap"] == "bitwise_mismatch"


# --- SUMMARY section and plot --------------------------------------------------------------------

def gpu_like_screen() -> tuple[dict, list[list]]:
    envs, rows = {}, []
    for env, (a, b) in {"warm": (103.8, 51.6), "scrubbed": (99.1, 96.0)}.items():
        a_us, b_us = samples(a), samples(b)
        envs[env] = envelope(a_us, b_us)
        rows += [[env, t * 5 // len(a_us), t, v, us] for v, xs in (("A", a_us), ("B", b_us)) for t, us in enumerate(xs)]
    verdict, reason = ov.overall_verdict(64, 64, envs)
    screen = {
        "device": "cuda", "gpu": "NVIDIA H200",
        "skipped": None,
        "shapes": {"source": "campaign", "K": 4096, "segments": [2048, 512, 64], "gemm_n": 1536, "reason": None,
                   "joined_n": 2624, "segment_dtypes": ["float32", "float32", "float16"], "dtype": "float16"},
        "variants": ov.DESCRIPTION,
        "bitwise": {"inputs": 64, "all_outputs_equal": 64, "graph_equal_eager": 64},
        "timing": {"measured": True, "reason": None, "trials": 40, "warmup": 20, "flush_bytes": 2 * 60 * 2**20,
                   "noise": 0.05, "envelopes": envs},
        "verdict": verdict, "verdict_reason": reason,
    }
    return screen, rows


def test_summary_section_cpu_and_gpu(cpu_run, tmp_path):
    ev, _ = cpu_run
    text = "\n".join(summary.overlap_section(ev))
    assert "### Overlap A/B screen (K=2048 → 32+16+8 (float32/float32/float16)" in text
    assert "**Verdict: `not_measured`**" in text and "on 16/16 freshly drawn input sets" in text
    assert f"Timing not measured: {ov.CPU_REASON}." in text and "plots/overlap.png" not in text  # nothing timed

    screen, rows = gpu_like_screen()
    gpu = tmp_path / "gpu"
    (gpu / "overlap").mkdir(parents=True)
    (gpu / "overlap/screen.json").write_text(json.dumps(screen))
    text = "\n".join(summary.overlap_section(gpu))
    assert screen["verdict"] == "no_claim" and "**Verdict: `no_claim`**" in text
    assert "graph replay of A = eager A on 64/64" in text
    header = next(line for line in text.splitlines() if line.startswith("| envelope"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "envelope", "A median µs (p10–p90)", "B median µs (p10–p90)", "B/A", "claim", "reason"]
    warm = next(line for line in text.splitlines() if line.startswith("| warm"))
    assert "B faster" in warm and "0.49" in warm and "103.8" in warm
    scrubbed = next(line for line in text.splitlines() if line.startswith("| scrubbed"))
    assert "no directional claim" in scrubbed and "within noise" in scrubbed and scrubbed.count("|") == 7
    assert summary.overlap_section(tmp_path / "none") == []  # no screen, no section

    # the timing plot: same screen and rows, same bytes
    one, two = ov.plot(screen, rows, tmp_path / "a.png"), ov.plot(screen, rows, tmp_path / "b.png")
    assert one.read_bytes().startswith(PNG) and one.read_bytes() == two.read_bytes()


# --- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the timing envelopes need a GPU")
def test_gpu_full_shapes_time_warm_and_scrubbed(tmp_path):
    ev = tmp_path / "ev"
    write_config(ev, "cuda", inputs=4, trials=10, warmup=2, **C4)
    s = ov.run(ev)
    assert s["shapes"]["source"] == "campaign" and s["shapes"]["joined_n"] == 2624
    assert s["bitwise"]["all_outputs_equal"] == 4 and s["bitwise"]["graph_equal_eager"] == 4
    tm = s["timing"]
    assert tm["measured"] and tm["flush_bytes"] >= 2 * tm["l2_bytes"] > 0
    for env in ov.ENVELOPES:
        for v in ov.VARIANTS:
            assert tm["envelopes"][env][v]["count"] == 10 and tm["envelopes"][env][v]["median_us"] > 0
    assert s["verdict"] in ("b_faster", "no_claim", "b_slower")
    lines = (ev / "overlap/timings.csv").read_text().splitlines()
    assert lines[0] == ov.CSV_HEADER.strip() and len(lines) == 1 + 2 * 2 * 10
    metrics = read_json(ev / "stages/overlap.json")["metrics"]
    assert {"warm_a_median_us", "warm_b_median_us", "scrubbed_b_over_a", "graph_equal_eager"} <= set(metrics)
