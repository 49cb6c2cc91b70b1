"""The bench stage of a finished campaign, rerun on an engine with a mutant of tests/mutants.py: does the rows check
of the distinct-prompts contract see it? (On the lent GPU machine, after the campaign, while it is warm.)

    python3 tools/device_bench_mutant.py evidence/<campaign>/<id> --mutant prefill_counts_padding --batch-sizes 8

Copies the evidence directory without its bench cells into --work, runs the pipeline's bench stage (backend single)
there on a scratch copy of engine/ with the mutant applied, on the campaign's checkpoint, and prints what it wrote
of each cell's rows check, or its refusal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import mutants  # noqa: E402

from evident.workflow.core import layout  # noqa: E402
from evident.workflow.core.evidence import DIR_MODE, FILE_MODE, read_config, read_json  # noqa: E402
from evident.workflow.plan.estimate import checkpoint_dir  # noqa: E402

RUN = mutants.GUARD + """
from evident.workflow.stages import bench
bench.main(["--checkpoint", sys.argv[2], "--evidence", sys.argv[3], "--backend", "single", "--kernels", sys.argv[4],
            "--batch-sizes", sys.argv[5]])
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evidence", type=Path, help="the campaign's evidence directory")
    ap.add_argument("--mutant", required=True, choices=sorted(mutants.MUTANTS))
    ap.add_argument("--batch-sizes", default="8")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the campaign's (its cache directory)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-mutant"))
    a = ap.parse_args()
    cfg = read_config(a.evidence / layout.CONFIG)
    ckpt = a.checkpoint or REPO / checkpoint_dir(cfg)
    shutil.rmtree(a.work, ignore_errors=True)
    ev = a.work / "evidence"
    shutil.copytree(a.evidence, ev, ignore=shutil.ignore_patterns(layout.BENCH, "bench-*.json", layout.SUMMARY))
    for p in [ev, *ev.rglob("*")]:  # writable again (files fetched from the lent machine arrive read-only)
        os.chmod(p, DIR_MODE if p.is_dir() else FILE_MODE)
    src = mutants.scratch(a.work / "src", a.mutant).resolve()
    # in the scratch directory, so that `engine` is the mutated copy (mutants.env)
    p = subprocess.run([sys.executable, "-c", RUN, str(src), str(ckpt.resolve()), str(ev.resolve()),
                        cfg["bench"]["kernels"], a.batch_sizes], env=mutants.env(src), cwd=src, text=True,
                       capture_output=True)
    print(p.stdout[-3000:], p.stderr[-3000:], f"[{a.mutant}] bench exit {p.returncode}", sep="\n")
    for cell in sorted((ev / "bench").glob("single-*.json")):
        c = read_json(cell)
        print(f"[{a.mutant}] {cell.stem}: rows {c['rows_check']['verdict']}, TPOT p50 {c['stats']['tpot']['p50']:.3f} ms")


if __name__ == "__main__":
    main()
