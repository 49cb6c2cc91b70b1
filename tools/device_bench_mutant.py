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
from workflow.evidence import read_config, read_json  # noqa: E402


RUN = """
import sys
import engine
assert engine.__file__.startswith(sys.argv[1]), engine.__file__
from workflow.stages import bench
bench.main(["--checkpoint", sys.argv[2], "--evidence", sys.argv[3], "--backend", "single", "--kernels", sys.argv[4],
            "--batch-sizes", sys.argv[5]])
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evidence", type=Path, help="the campaign's evidence directory")
    ap.add_argument("--mutant", required=True, choices=sorted(mutants.MUTANTS))
    ap.add_argument("--batch-sizes", default="8")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the one under .evident/checkpoints")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-mutant"))
    a = ap.parse_args()
    ckpt = a.checkpoint or next((REPO / ".evident/checkpoints").glob("*/config.json")).parent
    shutil.rmtree(a.work, ignore_errors=True)
    ev = a.work / "evidence"
    shutil.copytree(a.evidence, ev, ignore=shutil.ignore_patterns("bench", "bench-*.json", "SUMMARY.md"))
    os.chmod(ev, 0o755)
    for p in ev.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    src = mutants.scratch(a.work / "src", a.mutant).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO), os.environ.get("PYTHONPATH", "")])}
    kernels = read_config(ev / "config.yaml")["bench"]["kernels"]  # the campaign's decode path
    # run in the scratch directory: the interpreter puts it first on sys.path, so `engine` is the mutated copy
    p = subprocess.run([sys.executable, "-c", RUN, str(src), str(ckpt.resolve()), str(ev.resolve()), kernels,
                        a.batch_sizes], env=env, cwd=src, text=True, capture_output=True)
    print(p.stdout[-3000:], p.stderr[-3000:], f"[{a.mutant}] bench exit {p.returncode}", sep="\n")
    for cell in sorted((ev / "bench").glob("single-*.json")):
        c = read_json(cell)
        print(f"[{a.mutant}] {cell.stem}: rows {c['rows_check']['verdict']}, TPOT p50 {c['stats']['tpot']['p50']:.3f} ms")


if __name__ == "__main__":
    main()
