"""Stage `profile`: a kernel-level capture around `nsight.steps` decode steps of the engine.

The engine prefills one fixed prompt (`nsight.prompt`, copied to `nsight.batch` rows) under an NVTX range
`prefill`, then decodes `steps` greedy steps, each under an NVTX range `decode_step_<i>` (on the CPU the
same names as torch.profiler record_function ranges), after one untimed warm-up generation. The tool
(`nsight.tool`, auto = the first that can run): `ncu --clock-control none` over the decode steps (CUDA
profiler API range), else `nsys` (same range), else torch.profiler (CPU ops on the CPU, CUDA kernels on a
GPU) with a Chrome trace. The evidence records which tool ran and why each other did not.

The floor: the bytes a decode step must read (every weight once, but only the batch's embedding rows and the k
routed experts a layer that identical rows choose, plus the latent cache), over the copy bandwidth measured on
the same device, against the captured steps' kernel time.

Outputs: profile/capture.json (tool, reasons, steps, step times, floor, top kernels), profile/kernels.csv (name,
calls, total and mean µs, share of the captured decode steps), plots/profile.png, profile/trace.json.gz
(torch.profiler only), the SUMMARY section. Raw ncu/nsys reports stay out of the evidence (they carry host
names); the kernel table is what they measured.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import getpass
import gzip
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from workflow.environment import resolve_device
from workflow.evidence import Stage, read_config, write_bytes, write_text

TOOLS = ("ncu", "nsys", "torch")
CSV_HEADER = ["kernel", "calls", "total_us", "mean_us", "share_pct"]
TOOL_TIMEOUT_S = 540
UNITS_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


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


@torch.inference_mode()
def decode_steps(model, prompt_ids: list[int], batch: int, steps: int, cuda: bool, around=None) -> list[float]:
    """Prefill `batch` copies of the prompt row by row, then `steps` batched greedy decode steps; `around`
    (a context manager) wraps the decode steps only. Returns each step's wall time in µs."""
    from engine.model import LatentCache

    device = model.embed_tokens.weight.device
    graph = model.graph_decode  # the CUDA-graph step (bench.kernels: graph), captured in the warm-up call
    max_len = len(prompt_ids) + steps + 1
    cache = graph.cache(batch, max_len) if graph is not None else LatentCache.for_model(model, batch, max_len)
    nxt = []
    with marker("prefill", cuda):
        for r in range(batch):
            logits = model(torch.tensor([prompt_ids], device=device), cache, torch.tensor([r], device=device))
            nxt.append(logits[:, -1].argmax(-1))
    tokens = torch.stack(nxt).view(batch, 1)
    rows = torch.arange(batch, device=device)
    times = []
    if cuda:
        torch.cuda.synchronize()
    with around if around is not None else contextlib.nullcontext():
        for i in range(steps):
            t0 = time.perf_counter()
            with marker(f"decode_step_{i}", cuda):
                if graph is not None:
                    tokens = graph.step(cache, tokens.view(batch)).argmax(-1).view(batch, 1)
                else:
                    tokens = model(tokens, cache, rows)[:, -1].argmax(-1).view(batch, 1)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
    return times


@contextlib.contextmanager
def cuda_profiler_range():
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


# A kernel launched with PDL (kernels/pdl.py) starts before its predecessor ends and waits inside it, so a
# profiler would charge it that wait: the captured steps launch the ordinary way (the bench's TPOT keeps PDL).
LAUNCH = "ordinary: programmatic dependent launch off, so each kernel's duration is its own"


def _session(ckpt: Path, evidence: Path):
    """(config, the engine session to capture), the session's kernels launched the ordinary way (LAUNCH)."""
    from kernels import pdl
    from workflow.session import open_session

    config = read_config(evidence / "config.yaml")
    session = open_session(ckpt, evidence, "single", config.get("bench", {}).get("kernels", "torch"))

    @contextlib.contextmanager
    def ordinary():
        with pdl.disabled(), session as s:
            yield s

    return config, ordinary()


def worker(ckpt: Path, evidence: Path, out: Path) -> None:
    """Run under ncu/nsys: warm-up, then the decode steps inside the CUDA profiler API range; step times to `out`."""
    config, session = _session(ckpt, evidence)
    cfg = config["nsight"]
    with session as s:
        ids = s.tokenizer.encode(cfg["prompt"]).ids
        decode_steps(s.model, ids, cfg["batch"], cfg["steps"], True)  # warm-up: allocator, cuBLAS, Triton
        times = decode_steps(s.model, ids, cfg["batch"], cfg["steps"], True, around=cuda_profiler_range())
    Path(out).write_text(json.dumps({"step_us": times, "prompt_tokens": len(ids)}))


# --- tools -------------------------------------------------------------------------------------

def choose(requested: str, cuda: bool) -> tuple[list[str], dict[str, str]]:
    """Tools to try in order and why each other one is not tried."""
    why, order = {}, []
    for tool in ("ncu", "nsys"):
        if requested not in ("auto", tool):
            why[tool] = f"not requested (nsight.tool: {requested})"
        elif not cuda:
            why[tool] = "no CUDA device: it profiles GPU kernels"
        elif shutil.which(tool) is None:
            why[tool] = "not found on PATH"
        else:
            order.append(tool)
    if requested in ("ncu", "nsys") and not order:
        raise RuntimeError(f"nsight.tool is {requested} but it cannot run here: {why[requested]}; "
                           f"use nsight.tool auto or torch")
    if requested in ("auto", "torch"):
        order.append("torch")
    else:
        why["torch"] = f"not requested (nsight.tool: {requested})"
    return order, why


def _worker_cmd(ckpt: Path, evidence: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "workflow.stages.profile", "worker", "--checkpoint", str(ckpt.resolve()),
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
                           cwd=Path(__file__).resolve().parents[2])
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
          "--metrics", "gpu__time_duration.sum", "-f", "-o", str(rep), *_worker_cmd(ckpt, evidence, out)], log)
    p = subprocess.run(["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", "raw", "--metrics",
                        "gpu__time_duration.sum"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if p.returncode != 0:
        raise RuntimeError(f"ncu --import exited with {p.returncode}: {p.stderr.strip()[-300:]}")
    launches = parse_ncu_csv(p.stdout)
    steps = json.loads(out.read_text())
    return {"kernels": table(launches), "launches": len(launches), **steps,
            "share_basis": "sum of every kernel's GPU time in the captured decode steps (ncu serialises kernels)",
            "command": "ncu --clock-control none --profile-from-start off --target-processes all --nvtx "
                       "--metrics gpu__time_duration.sum -o <report> python -m workflow.stages.profile worker ...",
            "time_metric": "gpu__time_duration.sum"}


def capture_nsys(ckpt: Path, evidence: Path, tmp: Path, log: Path) -> dict:
    rep, out = tmp / "capture", tmp / "steps.json"
    _run(["nsys", "profile", "-t", "cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
          "-f", "true", "-o", str(rep), *_worker_cmd(ckpt, evidence, out)], log)
    _run(["nsys", "stats", "-r", "cuda_gpu_kern_sum", "-f", "csv", "-o", str(tmp / "sum"), f"{rep}.nsys-rep"], log)
    found = sorted(tmp.glob("sum*cuda_gpu_kern_sum*.csv"))
    if not found:
        raise RuntimeError("nsys stats wrote no cuda_gpu_kern_sum CSV")
    rows = parse_nsys_csv(found[0].read_text())
    steps = json.loads(out.read_text())
    return {"kernels": table(rows=rows), "launches": sum(r["calls"] for r in rows), **steps,
            "share_basis": "sum of every kernel's GPU time in the captured decode steps",
            "command": "nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi -o <report> python -m "
                       "workflow.stages.profile worker ...; nsys stats -r cuda_gpu_kern_sum",
            "time_metric": "nsys cuda_gpu_kern_sum Total Time"}


def _scrub(obj):
    subs = [(str(Path.home()), "~"), (socket.gethostname(), "<host>"), (getpass.getuser(), "<user>")]
    text = json.dumps(obj)
    for a, b in subs:
        if a and len(a) > 1:
            text = text.replace(json.dumps(a)[1:-1], b)
    return json.loads(text)


def capture_torch(ckpt: Path, evidence: Path, tmp: Path, cuda: bool) -> tuple[dict, bytes]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    config, session = _session(ckpt, evidence)
    cfg = config["nsight"]
    with session as s:
        ids = s.tokenizer.encode(cfg["prompt"]).ids
        decode_steps(s.model, ids, cfg["batch"], cfg["steps"], cuda)  # warm-up
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False) as prof:
            times = decode_steps(s.model, ids, cfg["batch"], cfg["steps"], cuda)
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
    data = gzip.compress(json.dumps(_scrub(keep), separators=(",", ":")).encode(), mtime=0)
    return {"kernels": table(launches, basis_us=basis), "launches": len(launches), "step_us": times,
            "prompt_tokens": len(ids), "what": kind,
            "share_basis": ("wall time of the decode steps (self CPU time of each op)" if not cuda
                            else "sum of every kernel's GPU time in the captured decode steps"),
            "command": "torch.profiler.profile(activities=[CPU" + (", CUDA" if cuda else "") + "]) in process",
            "time_metric": "self CPU time" if not cuda else "CUPTI kernel duration"}, data


# --- the floor ---------------------------------------------------------------------------------

def step_bytes(ckpt: Path, dtype: torch.dtype, batch: int, positions: int) -> dict:
    """The least a decode step of `batch` identical rows reads, by part, from the checkpoint's config alone (a
    model on the meta device holds no memory). Router gates are fp32, as the engine keeps them."""
    from engine.config import ModelArgs
    from engine.model import MoE, Transformer

    args = ModelArgs.load(str(ckpt))
    with torch.device("meta"):
        model = Transformer(args)
    size = lambda name, p: p.numel() * (4 if name.endswith(".gate.weight") else dtype.itemsize)  # noqa: E731
    params = dict(model.named_parameters())  # a tied lm_head is the embedding table: listed once
    routed = sum(size(n, p) for n, p in params.items() if ".experts." in n)
    experts = [l.mlp for l in model.layers if isinstance(l.mlp, MoE)]
    chosen = sum(m.top_k * sum(size(n, p) for n, p in next(iter(m.experts.values())).named_parameters())
                 for m in experts)
    table = 0 if args.tie_word_embeddings else size("embed_tokens.weight", params["embed_tokens.weight"])
    rows = batch * args.hidden_size * dtype.itemsize
    cache = args.num_hidden_layers * batch * positions * (args.kv_lora_rank + args.qk_rope_head_dim) * dtype.itemsize
    weights = sum(size(n, p) for n, p in params.items()) - routed - table
    return {"weights": weights, "chosen_experts": chosen, "embedding_rows": rows, "cache": cache,
            "total": weights + chosen + rows + cache}


def copy_bandwidth(device: str, mib: int = 512) -> float:
    """Bytes per second of a device-to-device copy (read plus write), the median of 10 after a warm-up."""
    n = (mib << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            t = time.perf_counter() - t0
        if i >= 3:
            times.append(t)
    return 2 * src.numel() * 4 / sorted(times)[len(times) // 2]


def floor(ckpt: Path, config: dict, device: str, prompt_tokens: int, kernel_us_per_step: float | None) -> dict:
    from workflow.checkpoints import DTYPES

    steps = config["nsight"]["steps"]
    parts = step_bytes(ckpt, DTYPES[config["dtype"]], config["nsight"]["batch"], prompt_tokens + (steps + 1) // 2)
    bw = copy_bandwidth(device, 512 if device.startswith("cuda") else 64)
    out = {"bytes": parts, "copy_bandwidth_GBps": bw / 1e9, "floor_us": parts["total"] / bw * 1e6,
           "kernel_us_per_step": kernel_us_per_step,
           "basis": "every weight read once, the batch's embedding rows, top_k routed experts a MoE layer (identical "
                    "rows route alike) and the latent cache at the captured steps' middle position, over the "
                    "measured device-to-device copy bandwidth"}
    if kernel_us_per_step:
        out["floor_fraction"] = out["floor_us"] / kernel_us_per_step
    return out


# --- plot, stage -------------------------------------------------------------------------------

def short(name: str, n: int = 60) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def plot(cap: dict, path: Path, top: int) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ks = cap["kernels"][:top]
    fig = Figure(figsize=(9, 1.2 + 0.35 * max(len(ks), 1)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    pos = list(range(len(ks)))[::-1]  # numeric positions: truncated names may repeat
    ax.barh(pos, [k["share_pct"] for k in ks], color="#4c72b0")
    ax.set_yticks(pos, [short(k["kernel"].removeprefix("void "), 50) for k in ks])
    for i, k in zip(pos, ks):
        ax.annotate(f"{k['total_us']:.0f} µs / {k['calls']}", (k["share_pct"], i), textcoords="offset points",
                    xytext=(4, 0), va="center", fontsize=7)
    ax.set_xlabel("share of the captured decode steps (%); labels: total time / calls", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(f"top {len(ks)} kernels — {cap['tool']}, {cap['steps']} decode steps, batch {cap['batch']}",
                 fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return write_bytes(path, buf.getvalue())


def run(ckpt: Path, evidence: Path) -> dict:
    config = read_config(evidence / "config.yaml")
    cfg = config["nsight"]
    device = resolve_device(config["device"])
    cuda = device.startswith("cuda")
    order, why = choose(cfg["tool"], cuda)
    params = {"tool": cfg["tool"], "steps": cfg["steps"], "batch": cfg["batch"], "device": device,
              "kernels": config.get("bench", {}).get("kernels", "torch")}
    with Stage(evidence, "profile", params=params) as st:
        log = evidence / "logs/profile-tool.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cap, trace, tool = None, None, None
        with tempfile.TemporaryDirectory(prefix="evident-profile-") as d:
            for t in order:
                try:
                    print(f"[profile] capturing {cfg['steps']} decode steps with {t}", flush=True)
                    if t == "ncu":
                        cap = capture_ncu(ckpt, evidence, Path(d), log)
                    elif t == "nsys":
                        cap = capture_nsys(ckpt, evidence, Path(d), log)
                    else:
                        cap, trace = capture_torch(ckpt, evidence, Path(d), cuda)
                    tool = t
                    break
                except Exception as e:  # noqa: BLE001 - a tool that fails is recorded, the next one tried
                    why[t] = f"tried and failed: {type(e).__name__}: {str(e)[:400]}"
                    print(f"[profile] {t} failed: {e}", flush=True)
                    if t == "torch":
                        raise
        if log.is_file():
            st.add_file(log)
        for t in order[order.index(tool) + 1:]:
            why.setdefault(t, f"not needed: {tool} ran")
        cap.update(tool=tool, not_run=why, steps=cfg["steps"], batch=cfg["batch"], device=device,
                   gpu=torch.cuda.get_device_name() if cuda else None, prompt=cfg["prompt"],
                   nvtx_ranges=["prefill"] + [f"decode_step_{i}" for i in range(cfg["steps"])],
                   versions={"torch": torch.__version__}, launch=LAUNCH)
        kernels = cap.pop("kernels")
        per_step = sum(k["total_us"] for k in kernels) / cfg["steps"] if cuda else None  # GPU time, every tool
        cap["floor"] = floor(ckpt, config, device, cap.get("prompt_tokens", 0), per_step)
        cap["top"] = kernels[: cfg["top"]]
        cap["kernel_count"] = len(kernels)
        st.add_file(write_text(evidence / "profile/kernels.csv", ",".join(CSV_HEADER) + "\n" + "".join(
            f"{json.dumps(k['kernel'])},{k['calls']},{k['total_us']:.3f},{k['mean_us']:.3f},{k['share_pct']:.3f}\n"
            for k in kernels)))
        if trace is not None:
            st.add_file(write_bytes(evidence / "profile/trace.json.gz", trace))
        st.add_file(plot({**cap, "kernels": kernels}, evidence / "plots/profile.png", cfg["top"]))
        st.write_json("profile/capture.json", _scrub(cap))
        st.tags["profile.tool"] = tool
        st.metrics["kernels"] = len(kernels)
        st.metrics["launches"] = cap["launches"]
        if cap.get("step_us"):
            st.metrics["step_us_median"] = sorted(cap["step_us"])[len(cap["step_us"]) // 2]
        if kernels:
            st.metrics["top_kernel_share_pct"] = kernels[0]["share_pct"]
        st.metrics["floor_us"] = cap["floor"]["floor_us"]
        if "floor_fraction" in cap["floor"]:
            st.metrics["floor_fraction"] = cap["floor"]["floor_fraction"]
        print(f"[profile] {tool}: {len(kernels)} kernels, {cap['launches']} launches; top: "
              + ", ".join(f"{short(k['kernel'], 40)} {k['share_pct']:.1f}%" for k in kernels[:3]), flush=True)
    return cap


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="(internal) the workload run under ncu/nsys")
    w.add_argument("--checkpoint", required=True, type=Path)
    w.add_argument("--evidence", required=True, type=Path)
    w.add_argument("--out", required=True, type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--evidence", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        return worker(args.checkpoint, args.evidence, args.out)
    if not (args.checkpoint and args.evidence):
        ap.error("--checkpoint and --evidence are required")
    try:
        run(args.checkpoint, args.evidence)
    except (RuntimeError, ValueError) as e:
        sys.exit(f"[profile] error: {e}")


if __name__ == "__main__":
    main()
