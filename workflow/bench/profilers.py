"""The profile capture's workload and the tools that capture it: ncu, nsys or torch.profiler.

The workload is `engine.generate` on one fixed prompt copied to `batch` rows: its prefill under a range `prefill`,
then `steps` greedy decode steps, each under `decode_step_<i>` (NVTX on CUDA, what ncu/nsys see; torch.profiler
ranges everywhere), after one untimed warm-up generation. ncu and nsys run it in a subprocess,
`python -m evident.workflow.bench.profilers worker`, and capture the CUDA profiler API range around the decode steps only;
torch.profiler runs it in process. Each driver returns the kernel table (`table`) and the step times.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from evident.engine.generate import generate
from evident.engine.graph_decode import screened
from evident.workflow.core import layout, privacy
from evident.workflow.core.evidence import read_config

TOOL_TIMEOUT_S = 540
UNITS_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
# A kernel launched with PDL (kernels/pdl.py) starts before its predecessor ends and waits inside it, so a
# profiler would charge it that wait: the captured steps launch the ordinary way (the bench's TPOT keeps PDL).
LAUNCH = "ordinary: programmatic dependent launch off, so each kernel's duration is its own"


# --- the captured workload -------------------------------------------------------------------

@contextlib.contextmanager
def marker(name: str, cuda: bool):
    """An NVTX range on CUDA (what ncu/nsys see) and a torch.profiler range everywhere."""
    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


def decode_steps(model, prompt_ids: list[int], batch: int, steps: int, cuda: bool,
                 profiled: bool = False) -> list[float]:
    """`steps` greedy decode steps of `batch` copies of the prompt through `engine.generate` (the model's decode
    path: eager, Triton or the CUDA-graph step), its prefill under `prefill`, each step under `decode_step_<i>`;
    `profiled`: the CUDA profiler API range opens before the first decode step and closes after the last.
    Returns each decode step's wall time in µs."""
    times = []

    @contextlib.contextmanager
    def around(step: int, total: int):
        if step == 1:
            with marker("prefill", cuda):
                yield
            return
        if profiled and step == 2:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        try:
            t0 = time.perf_counter()
            with marker(f"decode_step_{step - 2}", cuda):
                yield
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
        finally:
            if profiled and step == total:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()

    generate(model, [prompt_ids] * batch, steps + 1, around=around)  # no EOS: exactly `steps` decode steps
    return times


@contextlib.contextmanager
def session(ckpt: Path, evidence: Path):
    """The engine session to capture (bench.kernels' decode path), its kernels launched the ordinary way (LAUNCH)."""
    from evident.kernels import pdl
    from evident.workflow.models.session import open_session

    config = read_config(evidence / layout.CONFIG)
    with pdl.disabled(), open_session(ckpt, evidence, "single", config.get("bench", {}).get("kernels", "torch")) as s:
        yield s


def worker(ckpt: Path, evidence: Path, out: Path) -> None:
    """Run under ncu/nsys: warm-up, then the decode steps inside the CUDA profiler API range; step times to `out`."""
    with session(ckpt, evidence) as s:
        cfg = s.config["profile"]
        ids = s.tokenizer.encode(cfg["prompt"]).ids
        decode_steps(s.model, ids, cfg["batch"], cfg["steps"], True)  # warm-up: allocator, cuBLAS, Triton, graphs
        times = decode_steps(s.model, ids, cfg["batch"], cfg["steps"], True, profiled=True)
        Path(out).write_text(json.dumps({"step_us": times, "prompt_tokens": len(ids),
                                         "vocabulary_screened": screened(s.model, cfg["batch"])}))


# --- tools -------------------------------------------------------------------------------------

def choose(requested: str, cuda: bool) -> tuple[list[str], dict[str, str]]:
    """Tools to try in order and why each other one is not tried."""
    why, order = {}, []
    for tool in ("ncu", "nsys"):
        if requested not in ("auto", tool):
            why[tool] = f"not requested (profile.tool: {requested})"
        elif not cuda:
            why[tool] = "no CUDA device: it profiles GPU kernels"
        elif shutil.which(tool) is None:
            why[tool] = "not found on PATH"
        else:
            order.append(tool)
    if requested in ("ncu", "nsys") and not order:
        raise RuntimeError(f"profile.tool is {requested} but it cannot run here: {why[requested]}; "
                           f"use profile.tool auto or torch")
    if requested in ("auto", "torch"):
        order.append("torch")
    else:
        why["torch"] = f"not requested (profile.tool: {requested})"
    return order, why


def worker_cmd(ckpt: Path, evidence: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "evident.workflow.bench.profilers", "worker", "--checkpoint", str(ckpt.resolve()),
            "--evidence", str(evidence.resolve()), "--out", str(out)]


def _shown(cmd: list[str]) -> str:
    """The command as the log shows it: the worker's paths (checkpoint, evidence, temp files) elided."""
    out, hide = [], False
    for c in cmd:
        out.append("<path>" if hide or c.startswith(("/", tempfile.gettempdir())) else c)
        hide = c in ("--checkpoint", "--evidence", "--out", "-o")
    return " ".join("<path>" if o.startswith("<path>") else o for o in out)


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "ab") as f:
        f.write(("$ " + _shown(cmd) + "\n").encode())
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=TOOL_TIMEOUT_S,
                           cwd=Path(__file__).resolve().parents[2])  # the repository: `-m evident.workflow...` resolves
    if p.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {p.returncode}: " + " | ".join(tail))


def parse_ncu_csv(text: str) -> list[tuple[str, float]]:
    """(kernel name, µs) per launch from `ncu --import R --csv --page raw --metrics gpu__time_duration.sum`."""
    lines = [l for l in text.splitlines() if l.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        raise RuntimeError("ncu printed no CSV rows")
    head = rows[0]
    names = [c for c in ("Kernel Name", "Function Name", "Demangled Name") if c in head]
    if not names or "gpu__time_duration.sum" not in head:
        raise RuntimeError(f"ncu CSV lacks a kernel name or gpu__time_duration.sum column: {head[:16]}")
    name_col, time_col = head.index(names[0]), head.index("gpu__time_duration.sum")
    scale, out = 1e-3, []
    for r in rows[1:]:
        if r[0] == "" or not r[0].strip().isdigit():  # the units row
            scale = UNITS_US.get(r[time_col].strip(), scale)
            continue
        out.append((r[name_col], float(r[time_col].replace(",", "")) * scale))
    return out


def parse_nsys_csv(text: str) -> list[dict]:
    """Rows of `nsys stats -r cuda_gpu_kern_sum -f csv`: name, calls, total µs."""
    rows = list(csv.DictReader(io.StringIO(text[text.index('"Time') if '"Time' in text else text.index("Time"):])))
    return [{"kernel": r["Name"], "calls": int(r["Instances"]), "total_us": float(r["Total Time (ns)"]) * 1e-3}
            for r in rows]


def table(launches: list[tuple[str, float]] | None = None, rows: list[dict] | None = None,
          basis_us: float | None = None) -> list[dict]:
    """Per kernel: calls, total and mean µs, share of the basis (default: the sum of all kernels), by total."""
    agg: dict[str, dict] = {}
    for name, us in launches or []:
        a = agg.setdefault(name, {"kernel": name, "calls": 0, "total_us": 0.0})
        a["calls"] += 1
        a["total_us"] += us
    for r in rows or []:
        a = agg.setdefault(r["kernel"], {"kernel": r["kernel"], "calls": 0, "total_us": 0.0})
        a["calls"] += r["calls"]
        a["total_us"] += r["total_us"]
    basis = basis_us or sum(a["total_us"] for a in agg.values()) or 1.0
    out = sorted(agg.values(), key=lambda a: -a["total_us"])
    for a in out:
        a["mean_us"] = a["total_us"] / a["calls"] if a["calls"] else 0.0
        a["share_pct"] = 100.0 * a["total_us"] / basis
    return out


def capture_ncu(ckpt: Path, evidence: Path, tmp: Path, log: Path) -> dict:
    rep, out = tmp / "capture", tmp / "steps.json"
    _run(["ncu", "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all", "--nvtx",
          "--metrics", "gpu__time_duration.sum", "-f", "-o", str(rep), *worker_cmd(ckpt, evidence, out)], log)
    p = subprocess.run(["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", "raw", "--metrics",
                        "gpu__time_duration.sum"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if p.returncode != 0:
        raise RuntimeError(f"ncu --import exited with {p.returncode}: {p.stderr.strip()[-300:]}")
    launches = parse_ncu_csv(p.stdout)
    steps = json.loads(out.read_text())
    return {"kernels": table(launches), "launches": len(launches), **steps,
            "share_basis": "sum of every kernel's GPU time in the captured decode steps (ncu serialises kernels)",
            "command": "ncu --clock-control none --profile-from-start off --target-processes all --nvtx "
                       "--metrics gpu__time_duration.sum -o <report> python -m evident.workflow.bench.profilers worker ...",
            "time_metric": "gpu__time_duration.sum"}


def capture_nsys(ckpt: Path, evidence: Path, tmp: Path, log: Path) -> dict:
    rep, out = tmp / "capture", tmp / "steps.json"
    _run(["nsys", "profile", "-t", "cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
          "-f", "true", "-o", str(rep), *worker_cmd(ckpt, evidence, out)], log)
    _run(["nsys", "stats", "-r", "cuda_gpu_kern_sum", "-f", "csv", "-o", str(tmp / "sum"), f"{rep}.nsys-rep"], log)
    found = sorted(tmp.glob("sum*cuda_gpu_kern_sum*.csv"))
    if not found:
        raise RuntimeError("nsys stats wrote no cuda_gpu_kern_sum CSV")
    rows = parse_nsys_csv(found[0].read_text())
    steps = json.loads(out.read_text())
    return {"kernels": table(rows=rows), "launches": sum(r["calls"] for r in rows), **steps,
            "share_basis": "sum of every kernel's GPU time in the captured decode steps",
            "command": "nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi -o <report> python -m "
                       "workflow.profilers worker ...; nsys stats -r cuda_gpu_kern_sum",
            "time_metric": "nsys cuda_gpu_kern_sum Total Time"}


def capture_torch(ckpt: Path, evidence: Path, cuda: bool) -> tuple[dict, bytes]:
    """In process under torch.profiler: (the capture, its gzipped Chrome trace, scrubbed)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with session(ckpt, evidence) as s:
        cfg = s.config["profile"]
        ids = s.tokenizer.encode(cfg["prompt"]).ids
        decode_steps(s.model, ids, cfg["batch"], cfg["steps"], cuda)  # warm-up
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False) as prof:
            times = decode_steps(s.model, ids, cfg["batch"], cfg["steps"], cuda)
        screens = screened(s.model, cfg["batch"])
    events = prof.events()
    ranges = [(e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith("decode_step_") and e.device_type == DeviceType.CPU]
    inside = lambda e: any(a <= e.time_range.start and e.time_range.end <= b for a, b in ranges)  # noqa: E731
    if cuda:
        launches = [(e.name, e.time_range.elapsed_us()) for e in events
                    if e.device_type == DeviceType.CUDA and not e.name.startswith(("decode_step_", "prefill"))]
        # GPU kernels run after their launch: attribute by the capture (only decode steps follow the warm prefill)
        kind, basis = "CUDA kernels (torch.profiler, CUPTI)", None
        pre = [e for e in events if e.name == "prefill" and e.device_type == DeviceType.CPU]
        if pre:
            end = pre[0].time_range.end
            launches = [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA
                        and e.time_range.start >= end and not e.name.startswith(("decode_step_", "prefill"))]
    else:
        launches = [(e.name, float(e.self_cpu_time_total)) for e in events
                    if e.device_type == DeviceType.CPU and not e.name.startswith(("decode_step_", "prefill"))
                    and inside(e)]
        kind, basis = "CPU ops (aten), self time", sum(b - a for a, b in ranges)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    keep = {k: trace[k] for k in ("traceEvents", "displayTimeUnit", "deviceProperties", "schemaVersion") if k in trace}
    data = gzip.compress(json.dumps(privacy.scrub_json(keep), separators=(",", ":")).encode(), mtime=0)
    return {"kernels": table(launches, basis_us=basis), "launches": len(launches), "step_us": times,
            "prompt_tokens": len(ids), "vocabulary_screened": screens, "what": kind,
            "share_basis": ("wall time of the decode steps (self CPU time of each op)" if not cuda
                            else "sum of every kernel's GPU time in the captured decode steps"),
            "command": "torch.profiler.profile(activities=[CPU" + (", CUDA" if cuda else "") + "]) in process",
            "time_metric": "self CPU time" if not cuda else "CUPTI kernel duration"}, data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="(internal) the profile workload, run under ncu/nsys")
    ap.add_argument("cmd", choices=["worker"])
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--evidence", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    worker(a.checkpoint, a.evidence, a.out)


if __name__ == "__main__":
    main()
