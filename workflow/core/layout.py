"""The evidence directory as code: every file a campaign leaves in `evidence/<campaign>/<id>/`, named once.

Paths are relative to that directory, with `/` between parts. A name with a `{field}` is filled by the function
beside it. `FILES` is the contract a reviewer or another tool reads: docs/evidence.md's table is its print
(`python -m evident.workflow.core.layout`), and tests/test_layout.py fails on an evidence path written anywhere else.
This module imports nothing.
"""

from __future__ import annotations

import sys

# --- the archive: evidence/ and what the archive stage writes beside the directories -------------------------------
ROOT = "evidence"
INDEX = "index.html"  # the archive's front page, in ROOT
PAGES = "_pages"  # an HTML page per directory, in ROOT
TRENDS = "_trends"  # a campaign's trend CSV and PNG, in ROOT

# --- a directory's files -------------------------------------------------------------------------------------------
CONFIG = "config.yaml"
ENV = "env.json"
CHECKPOINT = "checkpoint.json"
ORACLE = "oracle/hf.json"
PARITY = "parity"
COMPARISON = f"{PARITY}/comparison.json"
BENCH = "bench"
BENCH_TABLE = f"{BENCH}/summary.csv"
BASELINE = f"{BENCH}/baseline.json"
PLOTS = "plots"
BENCH_PLOT = f"{PLOTS}/bench.png"
OVERLAP = "overlap"
SCREENS = f"{OVERLAP}/screens.json"
AUDIT = "kernels/audit.json"
QUALITY = "quality"
QUALITY_GATE = f"{QUALITY}/gsm8k-gate.json"
PROFILE = "profile"
CAPTURE = f"{PROFILE}/capture.json"
KERNEL_TABLE = f"{PROFILE}/kernels.csv"
TRACE = f"{PROFILE}/trace.json.gz"
PROFILE_PLOT = f"{PLOTS}/profile.png"
SOAK = "soak"
SOAK_GATE = f"{SOAK}/gate.json"  # the soak gate's verdict over its targets (target names may not be `gate`)
STAGES = "stages"
LOGS = "logs"
MANIFEST = "MANIFEST.json"
# The pull-request section: every gate's verdict and the headline figures first, no image and no link, so that it
# pastes into a GitHub comment whole (workflow/archive/summary.py).
SUMMARY = "SUMMARY.md"
# Beside it, what a comment has no room for: full tables, each first divergence, the plots (relative images: the
# archive page and MLflow show them).
DETAILS = "DETAILS.md"


def directory(campaign: str, eid: str) -> str:
    return f"{ROOT}/{campaign}/{eid}"


def parity_run(label: str) -> str:
    """One batch size of a parity run: `label` is runs.label's `<run>-b<B>` (or an engine target's)."""
    return f"{PARITY}/{label}.json"


def bench_cell(label: str) -> str:
    """A bench cell: `label` is runs.bench_cell's or runs.http_cell's."""
    return f"{BENCH}/{label}.json"


def rate_plot(target: str) -> str:
    """A target's rate rung: output tok/s and goodput against TPOT p50, a point a rate."""
    return f"{PLOTS}/rates-{target}.png"


def soak_record(target: str) -> str:
    """One target's soak: requests, errors, memory over time, latency drift, the server's death."""
    return f"{SOAK}/{target}.json"


BENCH_CELLS = f"{BENCH}/*-[bc]*.json"  # every cell's file, as a glob (summary.csv and baseline.json are not cells)
RATE_CELLS = f"{BENCH}/http-*-r*.json"  # the rate rung's cells, as a glob


def screen_files(name: str, builtin: bool) -> dict[str, str]:
    """A kernel screen's files. The built-in screen keeps the paths it had before there were others, so that older
    directories read the same."""
    if builtin:
        return {"screen": f"{OVERLAP}/screen.json", "timings": f"{OVERLAP}/timings.csv", "plot": f"{PLOTS}/overlap.png"}
    return {"screen": f"{OVERLAP}/{name}/screen.json", "timings": f"{OVERLAP}/{name}/timings.csv",
            "plot": f"{PLOTS}/overlap-{name}.png"}


def quality_result(target: str) -> str:
    return f"{QUALITY}/gsm8k-{target}.json"


def quality_rows(target: str) -> str:
    return f"{QUALITY}/gsm8k-{target}-rows.jsonl"


def stage_record(stage: str) -> str:
    return f"{STAGES}/{stage}.json"


def log(name: str) -> str:
    """A job's log, or a named log a stage keeps (`parity-<target>-server`)."""
    return f"{LOGS}/{name}.log"


def benchmark(rule: str) -> str:
    """Snakemake's time and memory record of a rule's job."""
    return f"{LOGS}/{rule}.benchmark.tsv"


_BUILTIN, _OWN = screen_files("", True), screen_files("<name>", False)
# The contract: (path, who writes it, what it holds). `<x>` is a part that varies. Sealing hashes every file into
# MANIFEST.json, which is written last.
FILES = (
    (CONFIG, "context", "the campaign as resolved: every key, defaults filled in, paths and URLs redacted"),
    (ENV, "context", "the machine: devices, package versions, threads (no host or user name)"),
    (CHECKPOINT, "record_checkpoint", "the checkpoint's files with their sha256, and tensors neither side reads"),
    (ORACLE, "oracle", "transformers' greedy traces: ids, text, hashes, per-step logit margins"),
    (parity_run("<run>-b<B>"), "parity, parity_target", "one run's traces at one batch size, forced runs"),
    (COMPARISON, "compare", "the parity verdict per cell and target, with each first divergence"),
    (bench_cell("<backend>[-distinct]-b<B>"), "bench", "one in-process cell: repeats, probes, stats, floor"),
    (bench_cell("http-<target>[-distinct]-c<C>"), "serve_bench", "one HTTP cell: per-request TTFT, ITL, TPOT, E2E"),
    (bench_cell("http-<target>-r<R>"), "serve_bench", "one rate of the rate rung: Poisson arrivals, vLLM's metrics, goodput"),
    (rate_plot("<target>"), "serve_bench", "a target's rates: output tok/s and goodput against TPOT p50"),
    (BENCH_TABLE, "bench_report", "one row per bench cell"),
    (BASELINE, "bench_report", "each cell against `bench.baseline`'s directory"),
    (BENCH_PLOT, "bench_report", "TPOT and throughput by batch size"),
    (soak_record("<target>"), "soak", "a target's soak: errors, the server's memory over time, latency drift, its death"),
    (SOAK_GATE, "soak", "the soak gate's verdict over the targets, with the reasons"),
    (_BUILTIN["screen"], "overlap", "the built-in screen: bitwise check and timings' verdict"),
    (_BUILTIN["timings"], "overlap", "the built-in screen's repeats"),
    (_BUILTIN["plot"], "overlap", "the built-in screen's plot"),
    (_OWN["screen"], "overlap", "a screen of the campaign's `screens:`"),
    (_OWN["timings"], "overlap", "that screen's repeats"),
    (_OWN["plot"], "overlap", "that screen's plot"),
    (SCREENS, "overlap", "every screen's verdict, where the campaign has screens of its own"),
    (AUDIT, "kernel_audit", "each Triton kernel's registers and spills on the campaign's shapes"),
    (quality_result("<target>"), "quality", "a target's GSM8K score and contract"),
    (quality_rows("<target>"), "quality", "a target's completions, a row per problem"),
    (QUALITY_GATE, "quality", "the quality gate's verdict between the targets"),
    (CAPTURE, "profile", "the profile capture: tool, steps, the floor"),
    (KERNEL_TABLE, "profile", "the captured kernels' times"),
    (TRACE, "profile", "the raw trace, where the tool gives one"),
    (PROFILE_PLOT, "profile", "the top kernels' times"),
    (stage_record("<stage>"), "every stage", "the stage's outcome: ok, failed, skipped or interrupted, and why"),
    (log("<rule>"), "every rule", "the job's output, scrubbed"),
    (benchmark("<rule>"), "every rule", "Snakemake's time and memory of the job"),
    (SUMMARY, "seal", "the pull-request section: gates first, no image or link"),
    (DETAILS, "seal", "the full tables and the plots"),
    (MANIFEST, "seal", "every file's sha256, the id's parts, the gates' verdicts; written last"),
)


def markdown() -> str:
    """FILES as docs/evidence.md shows it."""
    rows = [f"| `{path}` | {who} | {what} |" for path, who, what in FILES]
    return "\n".join(["| path | written by | holds |", "| --- | --- | --- |", *rows]) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
