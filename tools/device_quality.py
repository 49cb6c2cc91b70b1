"""The quality gate against engine mutants on a campaign's own checkpoint and contract: each mutant of
tests/mutants.py served from a scratch copy of the engine (mutants.serve) as an endpoint target, gated against
transformers by the quality stage, in a copy of the campaign's evidence (config.yaml and checkpoint.json).

    python3 tools/device_quality.py EVIDENCE_DIR CHECKPOINT_DIR --mutants norm_eps_x100,yarn_hard_ramp

Prints one line a candidate: verdict, counts, flips.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import mutants  # noqa: E402

from evident.workflow.core import layout
from evident.workflow.core.evidence import write_text  # noqa: E402
from evident.workflow.plan import environment  # noqa: E402
from evident.workflow.stages import quality  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("evidence", type=Path)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--mutants", required=True, help="comma-separated names of tests/mutants.py")
    args = ap.parse_args()
    names = args.mutants.split(",")
    cfg = yaml.safe_load((args.evidence / layout.CONFIG).read_text())
    device = environment.resolve_device(cfg["device"])
    cfg["quality"]["targets"] = ["hf"] + [{"name": mutants.endpoint_name(m), "url": "<url>"} for m in names]
    with tempfile.TemporaryDirectory() as tmp:
        ev = Path(tmp) / "ev"
        ev.mkdir()
        write_text(ev / layout.CONFIG, yaml.safe_dump(cfg, sort_keys=True))
        shutil.copy(args.evidence / layout.CHECKPOINT, ev / layout.CHECKPOINT)
        with contextlib.ExitStack() as servers:
            urls = {mutants.endpoint_name(m): servers.enter_context(
                mutants.serve(Path(tmp) / m, m, args.checkpoint, cfg["dtype"], device)) for m in names}
            doc = quality.run(args.checkpoint, ev, endpoints=urls)
    print(f"\ncandidate | {cfg['dtype']} verdict | counts | flips")
    for g in doc["gates"]:
        print(f"{g['candidate']} | {g['verdict']} | {g['counts']} | {len(g['flips'])}: "
              + ", ".join(f"q{f['id']} {f['reference']}->{f['candidate']}" for f in g["flips"]))


if __name__ == "__main__":
    main()
