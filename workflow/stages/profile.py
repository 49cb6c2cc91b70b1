"""Stage `profile`: a kernel-level capture around `profile.steps` decode steps of the engine.

The engine prefills one fixed prompt (`profile.prompt`, copied to `profile.batch` rows) under an NVTX range
`prefill`, then decodes `steps` greedy steps, each under an NVTX range `decode_step_<i>` (on the CPU the
same names as torch.profiler record_function ranges), after one untimed warm-up generation. The tool
(`profile.tool`, auto = the first that can run): `ncu --clock-control none` over the decode steps (CUDA
profiler API range), else `nsys` (same range), else torch.profiler (CPU ops on the CPU, CUDA kernels on a
GPU) with a Chrome trace. The evidence records which tool ran and why each other did not. The workload and the
tools are workflow/bench/profilers.py.

The floor (workflow/bench/floor.py): the bytes a decode step must read (every weight once, but only the batch's
embedding rows and the k routed experts a layer that identical rows choose, plus the latent cache; the vocabulary
projection's int8 screen in place of its weight where the captured steps picked through it), over the read
bandwidth measured on the same device, against the captured steps' kernel time.

Outputs: profile/capture.json (tool, reasons, steps, step times, floor, top kernels), profile/kernels.csv (name,
calls, total and mean µs, share of the captured decode steps), plots/profile.png, profile/trace.json.gz
(torch.profiler only), the SUMMARY section. Raw ncu/nsys reports stay out of the evidence (they carry host
names); the kernel table is what they measured.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from evident.workflow.bench import profilers
from evident.workflow.bench.floor import floor
from evident.workflow.core import layout, privacy
from evident.workflow.core.evidence import Stage, read_config, stage_args, write_bytes, write_text
from evident.workflow.core.plots import figure, save_png
from evident.workflow.plan.environment import resolve_device

CSV_HEADER = ["kernel", "calls", "total_us", "mean_us", "share_pct"]


def short(name: str, n: int = 60) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def plot(cap: dict, path: Path, top: int) -> Path:
    ks = cap["kernels"][:top]
    fig = figure(figsize=(9, 1.2 + 0.35 * max(len(ks), 1)))
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
    return save_png(fig, path, dpi=110)


def run(ckpt: Path, evidence: Path) -> dict:
    config = read_config(evidence / layout.CONFIG)
    cfg = config["profile"]
    device = resolve_device(config["device"])
    cuda = device.startswith("cuda")
    order, why = profilers.choose(cfg["tool"], cuda)
    params = {"tool": cfg["tool"], "steps": cfg["steps"], "batch": cfg["batch"], "device": device,
              "kernels": config.get("bench", {}).get("kernels", "torch")}
    with Stage(evidence, "profile", params=params) as st:
        log = evidence / layout.log("profile-tool")
        log.parent.mkdir(parents=True, exist_ok=True)
        cap, trace, tool = None, None, None
        with tempfile.TemporaryDirectory(prefix="evident-profile-") as d:
            for t in order:
                try:
                    print(f"[profile] capturing {cfg['steps']} decode steps with {t}", flush=True)
                    if t == "ncu":
                        cap = profilers.capture_ncu(ckpt, evidence, Path(d), log)
                    elif t == "nsys":
                        cap = profilers.capture_nsys(ckpt, evidence, Path(d), log)
                    else:
                        cap, trace = profilers.capture_torch(ckpt, evidence, cuda)
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
                   versions={"torch": torch.__version__}, launch=profilers.LAUNCH)
        kernels = cap.pop("kernels")
        per_step = sum(k["total_us"] for k in kernels) / cfg["steps"] if cuda else None  # GPU time, every tool
        cap["floor"] = floor(ckpt, config["dtype"], cfg["batch"], cfg["steps"], cap.get("prompt_tokens", 0), device,
                             per_step, cap.pop("vocabulary_screened"))
        cap["top"] = kernels[: cfg["top"]]
        cap["kernel_count"] = len(kernels)
        st.add_file(write_text(evidence / layout.KERNEL_TABLE, ",".join(CSV_HEADER) + "\n" + "".join(
            f"{json.dumps(k['kernel'])},{k['calls']},{k['total_us']:.3f},{k['mean_us']:.3f},{k['share_pct']:.3f}\n"
            for k in kernels)))
        if trace is not None:
            st.add_file(write_bytes(evidence / layout.TRACE, trace))
        st.add_file(plot({**cap, "kernels": kernels}, evidence / layout.PROFILE_PLOT, cfg["top"]))
        st.write_json(layout.CAPTURE, privacy.scrub_json(cap))
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
    args = stage_args(__doc__, checkpoint=True).parse_args(argv)
    try:
        run(args.checkpoint, args.evidence)
    except (RuntimeError, ValueError) as e:
        sys.exit(f"[profile] error: {e}")


if __name__ == "__main__":
    main()
