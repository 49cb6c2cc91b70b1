"""Stage `overlap`: kernel A/B screens, the built-in one (the auxiliary GEMVs split on the main stream vs fused on a
side stream) and the campaign's own (`screens:`, factories in the user's code).

The experiment is kernels/overlap.py (the screen contract, the bitwise comparison, the CUDA-graph timing); this
stage makes every screen (the built-in's factory with the campaign's shapes, then each of `screens:`, all made and
checked before any is measured), runs the experiment on each and writes the evidence: per screen its screen.json,
timings.csv and plot (workflow/plan/screens.py `files`), and, when the campaign has screens of its own, the index
overlap/screens.json with the stage's verdict (without, the built-in's screen.json is the stage's document).

The built-in's shapes: the campaign's model's own where it has the screened projections (`model_shapes`, as its
family says: a compressed sparse attention layer's auxiliary GEMVs; with the checkpoint, `layer_weights`: that
layer's own weights, in the campaign's dtype), else overlap.K, overlap.segments and overlap.gemm_n as the campaign
states them; with neither the built-in screen is recorded as skipped with SKIP_REASON (verdict `not_measured`; the
timings header only and a plot saying so), and so is the stage when the campaign has no screens of its own. Without
CUDA the bitwise part runs eagerly (the built-in through the Triton interpreter on small shapes, CPU_SHAPES) and
timing is recorded as not measured, with the reason; the timings then hold the header only.

A screen's verdict: any input set on which an output of A and B differ gives `bitwise_mismatch`. Otherwise B is
called faster or slower only beyond benchstats.NOISE in every envelope with neither variant noisy, a variant's
noise being the spread of its block medians (as bench's is the spread of its repeat medians). The stage's verdict
(`stage_verdict`) is `bitwise_mismatch` when any screen's is: the gate fails the run after sealing; the stage itself
still succeeds, so the evidence is written and sealed.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import torch

from evident.kernels.overlap import (
    BLOCKS,
    CONSUMER,
    CPU_SHAPES,
    DESCRIPTION,
    ENVELOPES,
    VARIANTS,
    ScreenError,
    bitwise,
    c4_screen,
    checked,
    layout,
    samples,
    timing,
)
from evident.workflow.bench import benchstats
from evident.workflow.core.evidence import Stage, read_config, stage_args, write_text
from evident.workflow.core.gates import BY_NAME, NOT_MEASURED
from evident.workflow.core.layout import CONFIG, SCREENS  # (kernels.overlap has its own `layout`)
from evident.workflow.core.plots import figure, save_png
from evident.workflow.models import checkpoints, families
from evident.workflow.plan import screens
from evident.workflow.plan.environment import require_interpreter, resolve_device

OVERLAP_GATE = BY_NAME["overlap"]
CPU_REASON = "no CUDA device: the Triton interpreter ran the bitwise part on small shapes"
NO_TIMING = "no CUDA device: the Triton interpreter ran the bitwise part; timing needs a GPU"
EAGER = "no CUDA device: the variants ran eagerly on the CPU (no side streams, no graphs); timing needs a GPU"
CPU_OWN = 1 << 18  # a model's own C4 layer this small (K x joined rows) runs under the interpreter as it is
SKIP_REASON = ("the campaign's model has no auxiliary GEMV projections to screen and the campaign states no "
               "overlap shapes")
STATED = ("K", "segments", "gemm_n")  # overlap keys that state the shapes: all three, or none
CSV_HEADER = "envelope,block,trial,variant,us\n"
VERDICTS = ("b_faster", "no_claim", "b_slower", "bitwise_mismatch", NOT_MEASURED)


# --- statistics and verdicts (pure) ----------------------------------------------------------

def variant_stats(us: list[float], blocks: int = BLOCKS) -> dict:
    """Median, spread and noise of one variant's trials (µs, in trial order).

    The trials are cut into `blocks` consecutive blocks (np.array_split, as the timing loop cuts them);
    `spread` = (max - min) / median of the block medians. Noisy when fewer than benchstats.MIN_REPEATS
    blocks or spread > benchstats.NOISE: a noisy variant makes no claim. Bad samples raise BenchError.
    """
    s = benchstats.stats(us)  # validates: finite, positive, non-empty
    arr = np.asarray(us, dtype=float)
    parts = np.array_split(arr, min(blocks, arr.size))
    medians = [float(np.median(p)) for p in parts]
    spread = (max(medians) - min(medians)) / float(np.median(medians))
    if len(parts) < benchstats.MIN_REPEATS:
        reason = f"only {len(parts)} block(s); at least {benchstats.MIN_REPEATS} are needed to measure noise"
    elif spread > benchstats.NOISE:
        reason = f"block median spread {spread:.4f} > {benchstats.NOISE}"
    else:
        reason = None
    p10, p90 = np.percentile(arr, [10, 90])
    return {"count": s["count"], "median_us": s["p50"], "p10_us": float(p10), "p90_us": float(p90),
            "min_us": s["min"], "max_us": s["max"], "mean_us": s["avg"], "block_medians_us": medians,
            "spread": float(spread), "noisy": reason is not None, "noise_reason": reason}


def envelope_claim(a: dict, b: dict) -> dict:
    """"B faster"/"B slower" on the medians, or "no directional claim" with the reasons.

    A claim needs neither variant noisy and |B - A| / A strictly above benchstats.NOISE. change_pct is
    (B - A) / A in percent (negative: B faster) and is reported even when noise blocks the claim.
    """
    reasons = [f"{name} noisy ({s['noise_reason']})" for name, s in (("A", a), ("B", b)) if s["noisy"]]
    ratio = b["median_us"] / a["median_us"]
    change = (ratio - 1.0) * 100.0
    if not reasons and abs(change) / 100.0 <= benchstats.NOISE:
        reasons.append(f"difference within noise ({change:+.2f}%, claims need more than ±{benchstats.NOISE * 100:g}%)")
    claim = "no directional claim" if reasons else ("B faster" if change < 0 else "B slower")
    return {"claim": claim, "ratio_b_over_a": ratio, "change_pct": change,
            "threshold_pct": benchstats.NOISE * 100, "reason": "; ".join(reasons) or None}


def overall_verdict(inputs: int, equal: int, envelopes: dict | None, not_measured: str | None = None) -> tuple[str, str]:
    """(verdict, reason): bitwise first, then timing. `b_faster`/`b_slower` only when every envelope
    claims it; anything else that was measured is `no_claim`."""
    if equal != inputs:
        return "bitwise_mismatch", f"{inputs - equal} of {inputs} input sets gave outputs of A and B that differ"
    if envelopes is None:
        return NOT_MEASURED, not_measured or "timing not measured"
    claims = {env: e["claim"] for env, e in envelopes.items()}
    if claims and all(c == "B faster" for c in claims.values()):
        return "b_faster", "B faster than A beyond the noise in every envelope (" + ", ".join(claims) + ")"
    if claims and all(c == "B slower" for c in claims.values()):
        return "b_slower", "B slower than A beyond the noise in every envelope (" + ", ".join(claims) + ")"
    return "no_claim", "; ".join(f"{env}: {e['claim']}" + (f" ({e['reason']})" if e["reason"] else "")
                                 for env, e in envelopes.items())


def stage_verdict(entries: list[dict]) -> tuple[str, str]:
    """(verdict, reason) of the stage over its screens' index entries: one screen's own; else `bitwise_mismatch` when
    any screen's is, else the verdict every measured screen shares, `no_claim` when they differ, `not_measured` when
    none was measured. The reason names the screens it comes from."""
    if len(entries) == 1:
        return entries[0]["verdict"], entries[0]["verdict_reason"]

    def says(es: list[dict]) -> str:
        return "; ".join(f"`{e['name']}` {e['verdict']}: {e['verdict_reason']}" for e in es)

    bad = [e for e in entries if e["verdict"] == "bitwise_mismatch"]
    if bad:
        return "bitwise_mismatch", says(bad)
    measured = [e for e in entries if e["verdict"] != NOT_MEASURED]
    if not measured:
        return NOT_MEASURED, says(entries)
    if len({e["verdict"] for e in measured}) == 1:
        return measured[0]["verdict"], says(measured)
    return "no_claim", "the screens differ: " + says(measured)


# --- plot ------------------------------------------------------------------------------------

def plot(screen: dict, rows: list[list], path: Path) -> Path:
    """Box plots of A and B per envelope (CUDA), or a panel saying what was checked (CPU) or why nothing was.
    Bare Figure on Agg, PNG "Software" chunk stripped: same input, same bytes (as benchstats.plot)."""
    bw, sh, timing_ = screen["bitwise"], screen["shapes"], screen["timing"]
    name = screen.get("name", screens.BUILTIN)
    title = "Overlap A/B screen" + ("" if name == screens.BUILTIN else f" `{name}`")
    head = (f"bitwise: {bw['all_outputs_equal']}/{bw['inputs']} input sets equal" if bw else "not measured")
    head += f"; verdict {screen['verdict']}"
    if not timing_["measured"]:
        lines = [(f"{title}: " + head, 10)]
        if sh:
            lines.append((f"K={sh['K']} -> {'+'.join(map(str, sh['segments']))} beside GEMM K={sh['K']} -> "
                          f"{sh['gemm_n']} ({sh['source']} shapes)", 9))
        elif bw:
            lines.append((f"{screen['factory']}, outputs " + ", ".join(o["name"] for o in bw["outputs"]), 9))
        lines.append((("timing: " if bw else "skipped: ") + timing_["reason"], 9))
        fig = figure(figsize=(7, 2.5))
        ax = fig.subplots()
        ax.axis("off")
        for y, (text, size) in zip(np.linspace(0.75, 0.25, len(lines)), lines):
            ax.text(0.5, y, text, ha="center", va="center", fontsize=size)
    else:
        fig = figure(figsize=(10, 4))
        axes = fig.subplots(1, len(ENVELOPES))
        for ax, env in zip(axes, ENVELOPES):
            ax.boxplot([samples(rows, env, v) for v in VARIANTS], showfliers=False, whis=(10, 90))
            ax.set_xticks([1, 2], ["A: split, main", "B: fused, aux"] if name == screens.BUILTIN else ["A", "B"])
            e = timing_["envelopes"][env]
            for x, v in enumerate(VARIANTS, start=1):
                ax.annotate(f"{e[v]['median_us']:.1f}", (x, e[v]["median_us"]), textcoords="offset points",
                            xytext=(18, 0), fontsize=8, va="center")
            ax.set_ylabel("graph replay (µs), whiskers p10/p90")
            ax.set_title(f"{env}: {e['claim']} (B/A {e['ratio_b_over_a']:.3f})", fontsize=10)
            ax.set_ylim(bottom=0)  # a zoomed axis would draw a 3% difference as a gulf
            ax.grid(True, axis="y", alpha=0.3)
        fig.suptitle(f"{title} — " + head, fontsize=10)
    fig.tight_layout()
    return save_png(fig, path, dpi=120)


# --- the stage -------------------------------------------------------------------------------

def _kernels(device: str):
    """The kernels, once the device is known (on a CPU through the interpreter)."""
    if device == "cpu":
        require_interpreter("the overlap screen")
    import evident.kernels.gemv as gemv

    return gemv


def model_shapes(model: dict) -> dict | None:
    """The screened projections of the model (its family's `overlap_fields`: transformers' DeepseekV4Config names),
    all reading hidden_size: a C4 layer's compressor kv_proj + gate_proj (2 x 2*head_dim), its indexer's kv_proj +
    gate_proj (2 x 2*index_head_dim) and scorer weights_proj (index_n_heads), beside q_a_proj (q_lora_rank) and
    kv_proj (head_dim) on the main stream. None for a model without them."""
    fields = families.of(model).overlap_fields(model)
    if fields is None:
        return None
    d, di = fields["head_dim"], fields["index_head_dim"]
    return {"K": fields["hidden_size"], "segments": [2 * 2 * d, 2 * 2 * di, fields["index_n_heads"]],
            "gemm_n": fields["q_lora_rank"] + d}


def shapes_of(config: dict, cuda: bool) -> dict | None:
    """The shapes this run screens, or None when there are none (the stage is skipped: SKIP_REASON).

    The model's own (model_shapes) where it has the screened projections, else overlap.K, segments and gemm_n
    as the campaign states them; the source is recorded. Without CUDA the run takes CPU_SHAPES, one segment
    per screened one, and records the screened shapes as `configured`."""
    cfg = config["overlap"]
    stated = {k: cfg[k] for k in STATED if cfg[k] is not None}
    if stated and len(stated) < len(STATED):
        raise ValueError(f"overlap.{', overlap.'.join(STATED)} state the shapes together or not at all "
                         f"(this campaign states only {', '.join(stated)})")
    model = model_shapes(config["checkpoint"].get("config") or {})
    if model and stated:
        raise ValueError("the campaign's model has the screened projections and the shapes come from it: "
                         f"leave overlap.{', overlap.'.join(STATED)} null")
    if not (model or stated):
        return None
    screened = {"source": "model" if model else "campaign", **(model or stated)}
    segs, dts = list(screened["segments"]), list(cfg["segment_dtypes"])
    if len(segs) != len(dts):
        raise ValueError(f"{screened['source']} segments {segs} and overlap.segment_dtypes {dts} differ in length")
    if cuda or (model and screened["K"] * sum(segs) <= CPU_OWN):
        shape = {**screened, "reason": None}
    else:
        shape = {"source": "cpu-small", **CPU_SHAPES, "segments": CPU_SHAPES["segments"][:len(segs)],
                 "reason": CPU_REASON, "configured": screened}
    return {**shape, "joined_n": sum(shape["segments"]), "segment_dtypes": dts, "dtype": cfg["dtype"]}


def layer_weights(ckpt: Path, model: dict, dtype: str) -> tuple[dict, tuple]:
    """The screened layer's own weights (its family's `own_layer`: the auxiliary rows joined in launch order and the
    GEMM's), in the campaign's dtype, every output in it too. (record, (w, wg))."""
    record, weights = families.of(model).own_layer(ckpt, model, checkpoints.DTYPES[dtype])
    return {**record, "dtype": dtype}, weights


def measure(made: tuple, label: str, cfg: dict, device: str, not_timed: str) -> tuple[dict, dict, list[list]]:
    """Run the experiment of kernels/overlap.py on a screen (`make`'s): (bitwise record, timing record, timing rows);
    without CUDA the timing is not measured, for the reason `not_timed`."""
    cuda = device.startswith("cuda")
    with torch.inference_mode():
        bits, graphs = bitwise(*made, device, cfg["inputs"], label)
        if not cuda:
            return bits, {"measured": False, "reason": not_timed, "envelopes": None}, []
        meta, rows = timing(graphs, cfg["trials"], cfg["warmup"], label)
    envelopes = {}
    for env in ENVELOPES:
        a, b = variant_stats(samples(rows, env, "A")), variant_stats(samples(rows, env, "B"))
        envelopes[env] = {"A": a, "B": b, **envelope_claim(a, b)}
    timed = {"measured": True, "reason": None, **meta, "noise": benchstats.NOISE, "envelopes": envelopes}
    return bits, timed, rows


def builtin_factory(shapes: dict, device: str, weights: tuple | None):
    """The built-in screen's factory with the campaign's shapes bound: called as factory(device), as the user's."""
    dt = checkpoints.DTYPES
    print(f"[overlap] {device}: K={shapes['K']} -> {'+'.join(map(str, shapes['segments']))} "
          f"({', '.join(shapes['segment_dtypes'])}) beside GEMM K={shapes['K']} -> {shapes['gemm_n']}"
          + ("" if device.startswith("cuda") else f"; {shapes['reason'] or NO_TIMING}"), flush=True)
    return functools.partial(c4_screen, gemv=_kernels(device), K=shapes["K"], sizes=shapes["segments"],
                             out_dtypes=[dt[d] for d in shapes["segment_dtypes"]], gemm_n=shapes["gemm_n"],
                             dtype=dt[shapes["dtype"]], weights=weights)


def make(name: str, ref: str, factory, device: str) -> tuple:
    """(Screen, its outputs' layout) from factory(device), A and B run once on input set 0; ScreenError naming the
    screen when it breaks the contract."""
    what = f"screen `{name}` ({ref})"
    try:
        screen = factory(device)
    except Exception as e:  # the user's factory failed: name it, keep the cause
        raise ScreenError(f"{what}: factory({device!r}) raised {type(e).__name__}: {e}") from e
    screen = checked(screen, what)
    with torch.inference_mode():
        return screen, layout(screen, device, what)


def screen_doc(entry: dict, made: tuple | None, shapes: dict | None, cfg: dict, device: str, common: dict
               ) -> tuple[dict, list[list]]:
    """(screen.json, timing rows) of one screen: `make`'s, measured; None: the built-in without shapes (skipped)."""
    name, ref = entry["name"], entry["module"]
    builtin = name == screens.BUILTIN
    label = "" if builtin else f"{name}: "
    if made is None:
        bits, rows = None, []
        timed = {"measured": False, "reason": SKIP_REASON, "envelopes": None}
        verdict, reason = NOT_MEASURED, SKIP_REASON
    else:
        bits, timed, rows = measure(made, label, cfg, device, (shapes["reason"] or NO_TIMING) if builtin else EAGER)
        verdict, reason = overall_verdict(bits["inputs"], bits["all_outputs_equal"], timed["envelopes"],
                                          timed["reason"])
    print(f"[overlap] {label}verdict {verdict}: {reason}", flush=True)
    return {
        "name": name, "factory": ref, **({"source_sha256": entry["source_sha256"]} if "source_sha256" in entry else {}),
        **common,
        "skipped": None if made else SKIP_REASON,
        "shapes": shapes if builtin else None,
        "streams": made[0].streams if made else None,
        "variants": DESCRIPTION if made is None else {"A": f"variant A of {ref}", "B": f"variant B of {ref}",
                                                      **(made[0].variants or {}), "consumer": CONSUMER},
        "bitwise": bits,
        "timing": timed,
        "timings_csv": "one row per timed replay" if rows else "header only: timing not measured",
        "verdict": verdict,
        "verdict_reason": reason,
    }, rows


def write_screen(st: Stage, evidence: Path, doc: dict, rows: list[list]) -> dict:
    """A screen's files (screen.json, timings.csv, plot) and metrics (the built-in's unprefixed, as they always
    were; another's prefixed `<name>.`); returns its entry in the index."""
    f = screens.files(doc["name"])
    st.write_json(f["screen"], doc)
    st.add_file(write_text(evidence / f["timings"],
                           CSV_HEADER + "".join(f"{e},{b},{t},{v},{us:.4f}\n" for e, b, t, v, us in rows)))
    st.add_file(plot(doc, rows, evidence / f["plot"]))
    bits, timed = doc["bitwise"], doc["timing"]
    prefix = "" if doc["name"] == screens.BUILTIN else f"{doc['name']}."
    if bits:
        st.metrics[f"{prefix}bitwise_inputs"] = bits["inputs"]
        st.metrics[f"{prefix}bitwise_equal"] = bits["all_outputs_equal"]
    if timed["measured"]:
        st.metrics[f"{prefix}graph_equal_eager"] = bits["graph_equal_eager"]
        for env, e in timed["envelopes"].items():
            st.metrics[f"{prefix}{env}_a_median_us"] = e["A"]["median_us"]
            st.metrics[f"{prefix}{env}_b_median_us"] = e["B"]["median_us"]
            st.metrics[f"{prefix}{env}_b_over_a"] = e["ratio_b_over_a"]
    return {"name": doc["name"], "factory": doc["factory"], "verdict": doc["verdict"],
            "verdict_reason": doc["verdict_reason"], "skipped": doc["skipped"], "inputs": bits and bits["inputs"],
            "all_outputs_equal": bits and bits["all_outputs_equal"], "files": f}


def run(evidence: Path, ckpt: Path | None = None) -> dict:
    """Every screen of the campaign; returns the built-in screen's document (overlap/screen.json)."""
    config = read_config(evidence / CONFIG)
    cfg = config["overlap"]
    own = config.get("screens") or []
    device = resolve_device(config["device"])
    cuda = device.startswith("cuda")
    with Stage(evidence, "overlap", params={"device": device}) as st:
        shapes = shapes_of(config, cuda)
        weights = None
        if shapes is not None and shapes["source"] == "model" and ckpt is not None:
            # the campaign's own layer: its weights, its K and N, and its dtype for the weights and outputs
            record, weights = layer_weights(ckpt, config["checkpoint"]["config"], config["dtype"])
            shapes = {**shapes, "weights": record, "dtype": config["dtype"],
                      "segment_dtypes": [config["dtype"]] * len(shapes["segments"])}
        builtin = {"name": screens.BUILTIN, "module": screens.BUILTIN_FACTORY}
        factories = [] if shapes is None else [(builtin, builtin_factory(shapes, device, weights))]
        if own and not cuda:
            require_interpreter("the campaign's screens")  # before their modules import Triton
        factories += [(e, screens.load(e["module"])) for e in own]
        made = {e["name"]: make(e["name"], e["module"], f, device) for e, f in factories}  # all, before any work
        if not made:
            st.skip(SKIP_REASON)
        else:
            st.params.update({"inputs": cfg["inputs"], "trials": cfg["trials"] if cuda else 0,
                              "warmup": cfg["warmup"] if cuda else 0})
        if shapes is not None:
            st.params.update({"shape_source": shapes["source"],
                              **{k: shapes[k] for k in ("K", "segments", "segment_dtypes", "gemm_n", "dtype")}})
        if own:
            st.params["screens"] = ",".join(e["name"] for e in own)
        common = {"device": device, "gpu": torch.cuda.get_device_name() if cuda else None,
                  "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton_interpret": not cuda,
                               "triton": getattr(sys.modules.get("triton"), "__version__", None)}}  # if imported
        docs, entries = {}, []
        for e in [builtin] + own:
            docs[e["name"]], rows = screen_doc(e, made.get(e["name"]), shapes, cfg, device, common)
            entries.append(write_screen(st, evidence, docs[e["name"]], rows))
        verdict, reason = stage_verdict(entries)
        if own:  # without screens of its own the built-in's screen.json is the stage's, as it always was
            st.write_json(SCREENS, {"verdict": verdict, "reason": reason, "screens": entries})
            print(f"[overlap] stage verdict {verdict}: {reason}", flush=True)
        st.tags[OVERLAP_GATE.tag] = verdict
    return docs[screens.BUILTIN]


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__)
    ap.add_argument("--checkpoint", type=Path, help="the campaign's checkpoint: a model's own C4 layer's weights")
    args = ap.parse_args(argv)
    try:
        run(args.evidence, args.checkpoint)
    except (ValueError, RuntimeError, benchstats.BenchError) as e:  # ScreenError, FactoryError are ValueErrors
        sys.exit(f"[overlap] error: {e}")


if __name__ == "__main__":
    main()
