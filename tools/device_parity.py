"""Parity checks of a GPU campaign, with the mutation suite, in one call on the lent GPU machine.

Writes a synthetic checkpoint of the campaign's model (optionally fewer layers), then runs the pipeline's own
stages as the rules do (checkpoint record, oracle, parity per decode path, compare) into one evidence directory;
then each mutant of tests/mutants.py through the parity stage's functions (torch path) and compare, against the
same oracle: the engine is loaded once in each dtype and the mutants are swapped in (mutants.applied), since a
load of 15.7B parameters per mutant would not fit the lease. Prints one table, a row as each run ends; the
evidence directory is packed into $OUT.

    python3 tools/device_parity.py config/campaigns/dsv2-lite-graph.yaml --kernels torch,graph \\
        --mutants norm_eps_x100,shared_experts_x0.98,route_drop_smallest,norm_in_low_dtype
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import mutants  # noqa: E402

from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json, write_json, write_text  # noqa: E402
from evident.workflow.models import (
    checkpoints,
    session,  # noqa: E402
)
from evident.workflow.parity import logprobs  # noqa: E402
from evident.workflow.plan import campaign
from evident.workflow.plan.runs import label  # noqa: E402
from evident.workflow.stages import checkpoint, compare, oracle, parity  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of this script on a tiny campaign
def campaign_config(path: Path, layers: int | None, batches: list[int], kernels: list[str]) -> dict:
    cfg = yaml.safe_load(path.read_text())
    schema = yaml.safe_load((REPO / "config/schema.yaml").read_text())["properties"]["parity"]["properties"]
    defaults = {k: v["default"] for k, v in schema.items() if "default" in v}
    cfg["parity"] = {**defaults, **cfg.get("parity", {}), "batch_sizes": batches, "backends": ["single"],
                     "kernels": kernels}
    cfg["checkpoint"].setdefault("config", {})
    problems: list = []
    if campaign.resolve_model(cfg, problems) is None or problems:  # checkpoint.base merged, as the workflow does
        raise SystemExit(f"{path}: {campaign.report(problems)}")
    if layers:
        cfg["checkpoint"]["config"]["num_hidden_layers"] = layers
    return cfg


def row(label: str, r: dict, seconds: float) -> str:
    out = []
    for f in r["forced"]:
        p, lg = f["precision"], f["logic"]
        prec = (f"{p['ratio']:.3f} (engine {p['engine']['mean']:.4f} / hf {p['transformers']['mean']:.4f}, "
                f"p99 {p['engine']['p99']:.3f}/{p['transformers']['p99']:.3f}, top-1 {p['engine']['top1_agreement']:.2f}/"
                f"{p['transformers']['top1_agreement']:.2f}, cases {', '.join(f'{v:.2f}' for v in p['case_ratios'].values())})"
                if p["applies"] else "n/a")
        rag = next((c["ragged"] for c in r["cells"] if c["case"] == "ragged" and c["batch"] == f["batch"]
                    and c["kernels"] == f["kernels"]), None)
        rag = "—" if rag is None else f"{rag['verdict']} ({len(rag['differences'])}/{len(rag['cases'])} rows differ)"
        out.append(f"| {label} | {f['kernels']} | b{f['batch']} | {r['verdict']} | {lg['max']:.3g} (mean {lg['mean']:.2g}, "
                   f"top-1 {lg['top1_agreement']:.2f}) | {prec} | {rag} | {seconds:.0f} s |")
    return "\n".join(out)


def diagnose(ckpt: Path, ev: Path, dtype: str) -> list[str]:
    """Where the engine's torch path loses precision against the float32 reference: the whole path in one forward
    (no decode steps) against prefill plus teacher-forced decode steps, each with cuBLAS's reduced-precision
    (bf16/fp16) split-K reductions allowed (torch's default) and not."""
    from evident.engine.checkpoint import load_model
    from evident.engine.generate import forced
    from evident.engine.model import LatentCache

    model = load_model(ckpt, device=DEVICE, dtype=checkpoints.DTYPES[dtype])
    o, lines = read_json(ev / layout.ORACLE), []
    matmul = torch.backends.cuda.matmul
    for reduced in (True, False):
        matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = reduced
        whole, decode = [], []
        with torch.inference_mode():
            for case in o["cases"]:
                ref, ids = case["reference"], case["prompt_ids"] + case["generated_ids"]
                logits = model(torch.tensor([ids], device=DEVICE), LatentCache.for_model(model, 1, len(ids)))[0, :-1]
                whole.append(logprobs.row_errors(ref, logprobs.at(logits, ref["top_ids"])))
                pos = logprobs.Positions(len(ref["top_ids"][0]), ref["top_ids"])
                forced(model, [case["prompt_ids"]], [case["generated_ids"]], pos)
                decode.append(logprobs.row_errors(ref, pos.rows[0]))
        for what, errs in (("whole path, one forward", whole), ("prefill + forced decode", decode)):
            st = logprobs.stats(errs)
            lines.append(f"| {what} | {reduced} | {st['mean']:.4f} | {st['p99']:.3f} | {st['max']:.3f} | "
                         f"{st['top1_agreement']:.3f} |")
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = True
    model.to("meta")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return ["| engine torch path | reduced-precision reductions | mean | p99 | max | top-1 |", "| --- | --- | --- | --- | --- | --- |",
            *lines]


def run_mutants(ckpt: Path, ev: Path, cfg: dict, names: list[str], batches: list[int]) -> list[str]:
    """Each mutant on the torch path, free-running and forced in every dtype parity runs, then compared."""
    o = read_json(ev / layout.ORACLE)
    rows = []
    with session.open_session(ckpt, ev, "single") as s:
        models = {cfg["dtype"]: s.model}
        for dtype in logprobs.dtypes(cfg["dtype"])[1:]:
            models[dtype] = session.load_engine(ckpt, s.device, dtype, None, "torch")
        for name in names:
            t = time.time()
            with contextlib.ExitStack() as stack:
                for m in models.values():
                    stack.enter_context(mutants.applied(m, name))
                records, alone = [], {}
                for b in batches:
                    s.model = models[cfg["dtype"]]
                    cases = parity.run_batch(s, b, f"{name} b{b}")
                    forced_runs = {}
                    for dtype, m in models.items():
                        s.model = m
                        forced_runs[dtype] = parity.run_forced(s, o, b)
                    # the last model is float32, as the stage's last load
                    records.append(parity.run_record(s, b, cases, forced_runs, parity.run_ragged(s, b, alone)))
            # the stage's own margin rule (a bf16 campaign's measured noise): a fixed floor judged a mutant's
            # divergence at a margin the unmutated run's comparison calls a near-tie
            result = compare.compare_parity(o, records, cfg)
            mutant = ev.with_name(f"{ev.name}-mutant-{name}")  # the records, for a later look
            for b, record in zip(batches, records):
                write_json(mutant / layout.parity_run(f'single-b{b}'), record)
            write_json(mutant / layout.COMPARISON, result)
            rows.append(row(name, result, time.time() - t))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("campaign", type=Path)
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--kernels", default="torch,graph")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--mutants", default="", help="comma-separated names of tests/mutants.py")
    ap.add_argument("--mutant-batch-sizes", default="1")
    ap.add_argument("--diagnose", action="store_true", help="where the torch path loses precision (one more load)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/device_parity"))
    ap.add_argument("--oracle-from", type=Path, help="an evidence directory of this campaign on the same checkpoint: "
                    "its oracle trace is reused (one load of the model in each dtype fewer)")
    a = ap.parse_args()
    kernels, batches = a.kernels.split(","), [int(b) for b in a.batch_sizes.split(",")]
    cfg = campaign_config(a.campaign, a.layers, batches, kernels)
    ckpt, ev = a.work / "ckpt", a.work / "evidence" / cfg["campaign"]
    shutil.rmtree(a.work / "evidence", ignore_errors=True)
    ev.mkdir(parents=True)
    write_text(ev / layout.CONFIG, yaml.safe_dump(cfg, sort_keys=True))
    t = time.time()
    if not (ckpt / "config.json").is_file():
        spec = cfg["checkpoint"]
        checkpoints.write_synthetic(ckpt, spec["config"], spec["seed"], spec["init_std"], cfg["dtype"], init_device=DEVICE)
    checkpoint.record(ckpt, ev)
    print(f"[device_parity] checkpoint {time.time() - t:.0f} s", flush=True)
    t = time.time()
    if a.oracle_from:  # the campaign's own oracle: same cases, and the checkpoint's files must be the same
        if read_json(a.oracle_from / layout.CHECKPOINT)["files"] != read_json(ev / layout.CHECKPOINT)["files"]:
            raise SystemExit(f"--oracle-from {a.oracle_from}: its oracle ran on another checkpoint")
        shutil.copytree(a.oracle_from / "oracle", ev / "oracle")
    else:
        oracle.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    print(f"[device_parity] oracle {time.time() - t:.0f} s", flush=True)
    # the torch path first, then the mutants and the diagnosis, then the other paths: partial output says most
    runs, table, diagnosis = [], [], []
    names = list(filter(None, a.mutants.split(",")))
    for i, k in enumerate(kernels):
        t = time.time()
        parity.main(["--checkpoint", str(ckpt), "--evidence", str(ev), "--backend", "single", "--kernels", k,
                     "--batch-sizes", a.batch_sizes])
        runs += [str(ev / layout.parity_run(label('single', k, b))) for b in batches]
        compare.main(["--evidence", str(ev), *runs])
        table.append(row("none", read_json(ev / layout.COMPARISON), time.time() - t))
        print(table[-1], flush=True)
        if i == 0 and names:
            table += run_mutants(ckpt, ev, cfg, names, [int(b) for b in a.mutant_batch_sizes.split(",")])
        if i == 0 and a.diagnose and cfg["dtype"] != logprobs.REFERENCE_DTYPE:
            diagnosis = diagnose(ckpt, ev, cfg["dtype"])
            print("\n".join(diagnosis), flush=True)
    out = Path(os.environ.get("OUT", a.work))
    with tarfile.open(out / "parity-evidence.tar.gz", "w:gz") as tar:
        tar.add(a.work / "evidence", arcname="evidence")
    print(f"\nlogic tolerance {cfg['parity']['logic_tolerance']:g}, precision bound {cfg['parity']['precision_bound']:g}, "
          f"{cfg['dtype']}, {cfg['checkpoint']['config']['num_hidden_layers']} layers")
    print("| mutant | path | batch | verdict | logic max abs delta, fp32 | precision ratio | ragged batch, fp32 | time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(table))
    print("\n".join(["", *diagnosis]))


if __name__ == "__main__":
    main()
