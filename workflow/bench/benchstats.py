"""Decode-benchmark statistics: per-cell summaries, the noise rule, directional claims, the table
and the plot.

A *cell* is one (backend, batch) pair of the decode benchmark. The bench stage measures
`repeats` runs of a fixed prompt and N new tokens; one repeat is recorded as

    {"ttft_ms": 12.3, "first_decode_ms": 4.1, "steady_ms": [3.9, 4.0, ...]}   # N - 2 steady

`ttft_ms` covers start -> every row has its first token, `first_decode_ms` the first -> second
token (kept apart because it still pays warm-up costs), and `steady_ms` the N - 2 remaining
decode intervals; each interval is one batched step producing one token for every row. A repeat recorded since
issue 64 also holds `probe_ms`, the machine probe timed right before it (stages/bench.py `probe`), which claims
between two directories read.

A cell of the benchmark over HTTP (stage serve_bench: `target`, `concurrency`) records, per
repeat, C streamed requests sent at once, each as the client saw it,

    {"duration_ms": 60.2, "requests": [{"chunk_ms": [12.3, 16.1, ...], "output_tokens": 16}, ...]}

`chunk_ms` the arrival of each server-sent event that carries a choice, in ms after the
request was sent (and `chunk_tokens`, the tokens each event carried, where the server says so on
every event); `request_metrics` turns it into vLLM `bench serve`'s TTFT, ITL, TPOT and
end-to-end latency, and `summarize_http` into the cell's percentiles, output tok/s and the same
noise rule (on each repeat's median TPOT).

A cell of the rate rung (`target`, `rate`) records N requests sent at Poisson arrivals whatever
the server answers (workflow/bench/load.py `sweep`), each as above or with the `error` that
ended it; `summarize_rate` gives vLLM's figures for one --request-rate: the percentiles over the
completed requests, request and output throughput, and goodput under an SLO.

Everything here fails closed: a sample that cannot be a real measurement (zero, negative,
NaN, inf, a missing or extra interval) raises BenchError instead of being averaged in, and two
cells are only called "faster"/"slower" when they measured the same thing and the difference
is larger than the run-to-run noise. Nothing here imports the engine or torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from evident.workflow.core import layout
from evident.workflow.core.evidence import read_json
from evident.workflow.parity.traces import markdown
from evident.workflow.plan.runs import SAME, SHORT, cell_label, cell_prompts, is_http, label_key

NOISE = 0.05
"""A cell is noisy when its per-repeat TPOT medians spread by more than this fraction of their
median: (max - min) / median > NOISE."""

MIN_REPEATS = 3
"""Fewer repeats than this cannot tell run-to-run noise from signal, so the cell is noisy."""

# Claims between two directories. A cell's spread is the noise inside one run; the machine can change between two
# runs (load, clocks, another tenant) and move every cell alike. So each repeat is preceded by a fixed machine probe
# (stages/bench.py `probe`: a matmul and a copy on the bench's device and threads), and a claim needs the change
# beyond what the machine's own change, by the probe, explains, and beyond a minimum effect. Figures (issue 64): 14
# identical runs of the default campaign's `single` bench stage, 4 of them under load, and 6 with a 2 ms sleep
# injected a decode step, on a shared 2-core CPU machine.
PROBE_LIMIT = 1.5
"""Two cells' probe medians further apart than this ratio (either way) were measured on a machine that differed too
much for any figure to be compared: no claim."""
MACHINE_POWER = 2
"""Within PROBE_LIMIT, a probe ratio r explains a TPOT p50 ratio up to r ** MACHINE_POWER the same way: identical runs
with probes 1.087x apart moved TPOT p50 by 17.9% (1.087 ** 2 = 1.18)."""
MIN_EFFECT = 0.10
"""The smallest TPOT p50 change a claim between two directories makes, beyond the machine's and whatever the spreads
(a quiet cell's is at most NOISE): identical runs, both cells quiet and their probes within 5%, moved by at most 6.8%
(median 2.5%)."""
UNPROBED_EFFECT = 0.15
"""The minimum effect where a cell has no probe (recorded before it existed): the machine is unchecked, so a claim
needs more; twice the 7.1% a change of load alone gave two such runs (issue 64)."""
PROBE_DRIFT = 0.05
"""Probe medians within this fraction are a like machine: the one `evident trend` compares a cell with."""

FRAME_COLUMNS = [
    "backend", "prompts", "batch", "ttft_p50_ms", "first_decode_p50_ms", "tpot_avg_ms", "tpot_p50_ms",
    "tpot_p95_ms", "tpot_p99_ms", "tpot_max_ms", "tpot_count", "decode_tok_s", "spread", "noisy",
    "first_warmup_over_repeat_s", "floor_ms", "floor_fraction", "floor_MB", "unique_experts_mean",
    "unique_experts_min", "unique_experts_max", "prefill_floor_ms", "ttft_over_prefill_floor",
]

MARKDOWN_HEADER = [
    "backend", "prompts", "batch", "steady TPOT p50 (ms)", "TPOT avg (ms)", "p95", "decode tok/s", "floor (ms)",
    "floor / TPOT p50", "unique experts a MoE layer", "noisy",
]

_CELL_KEYS = ("backend", "batch", "contract", "versions", "model", "stats")
_HTTP_KEYS = ("target", "concurrency", "contract", "versions", "model", "stats")

HTTP_METRICS = ("ttft", "tpot", "itl", "e2e")  # each at p50, p95, p99 (ms)
HTTP_COLUMNS = [
    "transport", "target", "prompts", "concurrency",
    *(f"{m}_{q}_ms" for m in HTTP_METRICS for q in ("p50", "p95", "p99")),
    "output_tok_s", "spread", "noisy", "refused", "inprocess_cell", "http_over_inprocess_tpot_p50",
    "http_over_inprocess_ttft_p50", "http_itl_p50_over_inprocess_tpot_p50", "http_tpot_p99_over_inprocess_tpot_p50",
    "side_by_side_claim", "side_by_side_reason",
]
"""summary.csv's rows of the HTTP cells (`transport` http), after the in-process rows (`transport` in-process)."""
IN_PROCESS, OVER_HTTP = "in-process", "http"
SIDE_BY_SIDE_KEYS = ("prompt_sha256", "prompts_sha256", "prompt_tokens", "new_tokens", "dtype", "device")
"""What the builtin engine's HTTP cell and its in-process cell must share to stand side by side (the rest of their
contracts, the timer and the transport above all, differ by design)."""



def measured_with(evidence: Path) -> tuple[dict, dict]:
    """What a bench cell records it ran on: the package versions and device of env.json, and the checkpoint's file
    hashes (a claim across cells needs both equal)."""
    env = read_json(evidence / layout.ENV)
    versions = {**env["packages"], "cuda": env.get("cuda"), "gpus": env.get("gpus"), "driver": env.get("driver")}
    return versions, {n: f["sha256"] for n, f in read_json(evidence / layout.CHECKPOINT)["files"].items()}


class BenchError(ValueError):
    """A benchmark record that cannot be trusted; raised instead of producing a number."""


# --- samples ---------------------------------------------------------------------------------

def _samples(samples, what: str = "samples") -> np.ndarray:
    """Convert to a float array and reject anything that is not a real, positive duration.

    Zero means the timer did not cover the work (or its resolution is too coarse); negative
    means clock misuse; NaN/inf means a broken measurement. Any of them would silently bend an
    average or a percentile, so they stop the stage instead.
    """
    if samples is None or isinstance(samples, (str, bytes, dict)):
        raise BenchError(f"{what}: expected a list of durations, got {type(samples).__name__}")
    try:
        arr = np.asarray(list(samples), dtype=float)
    except (TypeError, ValueError) as exc:
        raise BenchError(f"{what}: not numeric ({exc})") from None
    if arr.ndim != 1:
        raise BenchError(f"{what}: expected a flat list, got shape {arr.shape}")
    if arr.size == 0:
        raise BenchError(f"{what}: no samples")
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BenchError(f"{what}: sample {i} is {arr[i]} (not finite)")
    nonpos = arr <= 0
    if nonpos.any():
        i = int(np.flatnonzero(nonpos)[0])
        raise BenchError(f"{what}: sample {i} is {arr[i]} (<= 0: the timer did not cover the work)")
    return arr


def stats(samples: list[float]) -> dict:
    """count/avg/p50/p95/p99/max/min of positive durations (ms).

    Percentiles use numpy's default (linear interpolation between closest ranks), so any reader
    can recompute them from the raw samples with `np.percentile`.
    """
    arr = _samples(samples)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {
        "count": int(arr.size),
        "avg": float(arr.mean()),
        "p50": float(p50),
        "p95": float(p95),
        "p99": float(p99),
        "max": float(arr.max()),
        "min": float(arr.min()),
    }


# --- one cell --------------------------------------------------------------------------------

def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise BenchError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def tok_s(batch: int, steady_ms) -> float:
    """Decode throughput over steady intervals: batch * steps / seconds (a throughput, not 1000 / mean TPOT)."""
    steps = np.asarray(steady_ms, dtype=float)
    return batch * steps.size / (float(steps.sum()) / 1000.0)


def summarize_cell(repeats: list[dict], batch: int, new_tokens: int) -> dict:
    """Validate every repeat of one (backend, batch) cell and summarize it.

    Steady TPOT pools the steady intervals of all repeats (a step is a step, whichever repeat
    it came from). decode_tok_s counts tokens actually produced over the time actually spent:
    batch * steady steps / steady seconds, so it is a throughput, not 1000 / mean TPOT.

    Noise is judged between repeats, not within one: `repeat_tpot_p50` is each repeat's steady
    median and `spread` = (max - min) / median of those. The cell is noisy when spread > NOISE,
    or when it has fewer than MIN_REPEATS repeats: with one or two repeats the spread is not an
    estimate of the noise at all (one repeat always gives 0), so the cell cannot support a
    claim. `spread` is still reported as computed (0.0 for a single repeat), and `noise_reason`
    says why a cell is noisy (None when it is not).
    """
    batch = _positive_int(batch, "batch")
    new_tokens = _positive_int(new_tokens, "new_tokens")
    if new_tokens < 3:
        raise BenchError(f"new_tokens must be >= 3 to have any steady decode interval, got {new_tokens}")
    if not isinstance(repeats, (list, tuple)) or not repeats:
        raise BenchError("no repeats to summarize")
    expected = new_tokens - 2

    ttft, first, steady, per_repeat = [], [], [], []
    for i, rep in enumerate(repeats):
        if not isinstance(rep, dict):
            raise BenchError(f"repeat {i}: expected a dict, got {type(rep).__name__}")
        missing = [k for k in ("ttft_ms", "first_decode_ms", "steady_ms") if k not in rep]
        if missing:
            raise BenchError(f"repeat {i}: missing {', '.join(missing)}")
        s = _samples(rep["steady_ms"], f"repeat {i} steady_ms")
        if s.size != expected:
            raise BenchError(
                f"repeat {i}: {s.size} steady samples, expected {expected} (new_tokens {new_tokens} - 2)"
            )
        ttft.append(float(_samples([rep["ttft_ms"]], f"repeat {i} ttft_ms")[0]))
        first.append(float(_samples([rep["first_decode_ms"]], f"repeat {i} first_decode_ms")[0]))
        steady.append(s)
        per_repeat.append(float(np.median(s)))

    all_steady = np.concatenate(steady)
    decode_tok_s = tok_s(batch, all_steady)
    return {
        "ttft": stats(ttft),
        "first_decode": stats(first),
        "tpot": stats(all_steady.tolist()),
        "decode_tok_s": float(decode_tok_s),
        **noise(per_repeat),
        **probe(repeats),
    }


def probe(repeats: list[dict]) -> dict:
    """The machine probe of a cell's repeats (`probe_ms`, timed before each): `repeat_probe_ms` and their median
    `probe_ms`; nothing for a cell recorded before the probe existed. Some repeats with it and some without is not a
    record to trust."""
    have = [isinstance(r, dict) and "probe_ms" in r for r in repeats]
    if not any(have):
        return {}
    if not all(have):
        raise BenchError(f"repeat {have.index(False)}: no probe_ms where other repeats have one")
    ms = _samples([r["probe_ms"] for r in repeats], "probe_ms")
    return {"repeat_probe_ms": ms.tolist(), "probe_ms": float(np.median(ms))}


def noise(per_repeat: list[float]) -> dict:
    """The noise rule on a cell's per-repeat TPOT medians: `repeat_tpot_p50`, `spread`, `noisy`, `noise_reason`."""
    spread = (max(per_repeat) - min(per_repeat)) / float(np.median(per_repeat))
    if len(per_repeat) < MIN_REPEATS:
        reason = f"only {len(per_repeat)} repeat(s); at least {MIN_REPEATS} are needed to measure run-to-run noise"
    elif spread > NOISE:
        reason = f"repeat TPOT p50 spread {spread:.4f} > {NOISE}"
    else:
        reason = None
    return {"repeat_tpot_p50": [float(v) for v in per_repeat], "spread": float(spread), "noisy": reason is not None,
            "noise_reason": reason}


# --- a cell of the benchmark over HTTP ------------------------------------------------------

def request_metrics(chunk_ms, output_tokens: int, chunk_tokens=None) -> dict:
    """One streamed request as vLLM's `bench serve` measures it on the client (all in ms):

    - TTFT: request sent -> the first event carrying a choice (`chunk_ms[0]`);
    - ITL: the intervals between successive such events (a server that sends several tokens in one event gives
      fewer, longer intervals);
    - E2E: request sent -> the last such event;
    - TPOT: (E2E - TTFT) / (output tokens - 1), the mean time per output token after the first.

    Where the stream says how many tokens each event carried (`chunk_tokens`: usage.completion_tokens on every
    event, vLLM's continuous_usage_stats), TPOT divides by the tokens after the first event instead: the tokens
    the first event carried were decoded before TTFT, and spreading the time after it over them reads faster than
    any decode step. An event a token gives vLLM's figure.

    Fails closed: no event, events out of order, one event for several tokens (not streamed: no TPOT), fewer
    than two output tokens, or counts an event that do not add up to the output tokens.
    """
    t = _samples(chunk_ms, "chunk_ms")
    if np.any(np.diff(t) < 0):
        raise BenchError("chunk_ms: events out of order (the client's clock went backwards)")
    n = _positive_int(output_tokens, "output_tokens")
    if n < 2:
        raise BenchError(f"{n} output token: TPOT needs at least 2")
    first = 1
    if chunk_tokens is not None:
        k = np.asarray(chunk_tokens, dtype=int)
        if k.shape != t.shape or np.any(k < 0) or int(k.sum()) != n:
            raise BenchError(f"chunk_tokens {list(chunk_tokens)[:8]}: not a count for each of {t.size} events adding "
                             f"up to {n} output tokens")
        first = max(1, int(k[0]))
    if t.size < 2 or first >= n:
        raise BenchError(f"{n} output tokens arrived in one event: the server did not stream them (no TPOT, no ITL)")
    return {"ttft_ms": float(t[0]), "itl_ms": np.diff(t).tolist(), "e2e_ms": float(t[-1]),
            "tpot_ms": float((t[-1] - t[0]) / (n - first)), "output_tokens": n}


def round_tok_s(rep: dict) -> float:
    """One round of an HTTP cell: its requests' output tokens over its duration, a second."""
    return sum(r["output_tokens"] for r in rep["requests"]) / (float(rep["duration_ms"]) / 1000.0)


def summarize_http(repeats: list[dict], concurrency: int, new_tokens: int) -> dict:
    """Validate every repeat of one HTTP cell and summarize it: TTFT, TPOT and E2E over every request, ITL over
    every interval of every request (vLLM's pooling), each at avg/p50/p95/p99; output tok/s = all output tokens /
    all repeats' durations (each from the first request sent to the last stream's end); the noise rule on each
    repeat's median TPOT. A repeat must hold `concurrency` requests, and each request exactly `new_tokens` output
    tokens: a server that stopped early (or ran on) measured another contract, and no figure is claimed."""
    concurrency = _positive_int(concurrency, "concurrency")
    new_tokens = _positive_int(new_tokens, "new_tokens")
    if not isinstance(repeats, (list, tuple)) or not repeats:
        raise BenchError("no repeats to summarize")
    per: dict[str, list] = {m: [] for m in HTTP_METRICS}
    per_repeat, tokens, seconds = [], 0, 0.0
    for i, rep in enumerate(repeats):
        reqs = rep.get("requests") if isinstance(rep, dict) else None
        if not isinstance(reqs, list) or len(reqs) != concurrency:
            raise BenchError(f"repeat {i}: {len(reqs) if isinstance(reqs, list) else 'no'} requests, expected "
                             f"{concurrency} (the concurrency)")
        tpots = []
        for j, req in enumerate(reqs):
            if req.get("output_tokens") != new_tokens:
                raise BenchError(f"repeat {i} request {j}: {req.get('output_tokens')} output tokens where the contract "
                                 f"asks {new_tokens} (the server stopped early or ran on): no figure is claimed")
            try:
                m = request_metrics(req.get("chunk_ms"), req["output_tokens"], req.get("chunk_tokens"))
            except BenchError as e:
                raise BenchError(f"repeat {i} request {j}: {e}") from None
            per["ttft"].append(m["ttft_ms"])
            per["e2e"].append(m["e2e_ms"])
            per["itl"] += m["itl_ms"]
            per["tpot"].append(m["tpot_ms"])
            tpots.append(m["tpot_ms"])
            tokens += m["output_tokens"]
        duration = float(_samples([rep.get("duration_ms")], f"repeat {i} duration_ms")[0])
        if duration < max(r["chunk_ms"][-1] for r in reqs):
            raise BenchError(f"repeat {i}: duration {duration} ms is shorter than a request it holds")
        per_repeat.append(float(np.median(_samples(tpots, f"repeat {i} TPOT"))))
        seconds += duration / 1000.0
    out = {m: stats(v) for m, v in per.items()}
    return {**out, "output_tok_s": tokens / seconds, **noise(per_repeat), **probe(repeats)}


# --- a cell of the rate rung ----------------------------------------------------------------

def good(metrics: dict, slo: dict) -> bool:
    """A completed request meets the SLO: its TTFT and its TPOT each at most the limit (vLLM's --goodput)."""
    return metrics["ttft_ms"] <= slo["ttft_ms"] and metrics["tpot_ms"] <= slo["tpot_ms"]


def summarize_rate(requests: list[dict], duration_ms: float, new_tokens: int, slo: dict | None) -> dict:
    """One rate of the rate rung as vLLM's `bench serve` reports a --request-rate run: TTFT, TPOT, E2E and ITL
    (avg/p50/p95/p99) over the completed requests, `request_throughput` (completed a second), `output_tok_s` and,
    under an SLO, `goodput` (good requests a second: vLLM's request_goodput), each over the cell's duration (the
    first request sent to the last answer's end). A request that failed (`error`: an error status, a reset or
    refused connection, a broken stream) or that cannot be measured (not streamed, another number of tokens than
    the contract's) is counted in `failed` with why (`failures`): it completed nothing and misses the SLO. A cell of
    no completed request has no percentiles (None)."""
    new_tokens = _positive_int(new_tokens, "new_tokens")
    if not isinstance(requests, list) or not requests:
        raise BenchError("no requests to summarize")
    seconds = float(_samples([duration_ms], "duration_ms")[0]) / 1000.0
    per: dict[str, list] = {m: [] for m in HTTP_METRICS}
    failures, tokens, good_ = [], 0, 0
    for i, req in enumerate(requests):
        why = req.get("error")
        if why is None:
            try:
                if req.get("output_tokens") != new_tokens:
                    raise BenchError(f"{req.get('output_tokens')} output tokens where the contract asks {new_tokens}")
                m = request_metrics(req.get("chunk_ms"), req["output_tokens"], req.get("chunk_tokens"))
            except BenchError as e:
                why = str(e)
        if why is not None:
            failures.append({"request": i, "error": why})
            continue
        for k in ("ttft", "tpot", "e2e"):
            per[k].append(m[f"{k}_ms"])
        per["itl"] += m["itl_ms"]
        tokens += m["output_tokens"]
        good_ += bool(slo) and good(m, slo)
    completed = len(requests) - len(failures)
    return {**{m: stats(v) if v else None for m, v in per.items()},
            "requests": len(requests), "completed": completed, "failed": len(failures), "failures": failures,
            "duration_s": seconds, "request_throughput": completed / seconds, "output_tok_s": tokens / seconds,
            "slo": slo, "good": good_ if slo else None, "goodput": good_ / seconds if slo else None}


def rate_plot(cells: list[dict], path: str | Path) -> Path:
    """A target's rate rung, a point a rate (labelled with it), in rate order: output tok/s against TPOT p50 and,
    where the cells have an SLO, goodput against TPOT p50 (else request throughput): the Pareto frontier of
    throughput against latency. A rate whose requests all failed has no TPOT and no point."""
    from evident.workflow.core.plots import figure, save_png

    points = sorted((c for c in cells if (c.get("stats") or {}).get("tpot")), key=lambda c: float(c["rate"]))
    if not points:
        raise BenchError("nothing to plot: no rate completed a request")
    slo = points[0]["stats"]["slo"]
    fig = figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    x = [c["stats"]["tpot"]["p50"] for c in points]
    second = ("goodput", "goodput (good requests/s)") if slo else ("request_throughput", "request throughput (/s)")
    for ax, (key, ylabel) in zip(axes, (("output_tok_s", "output throughput (tokens/s)"), second)):
        y = [c["stats"][key] for c in points]
        ax.plot(x, y, "-o")
        for c, xi, yi in zip(points, x, y):
            ax.annotate(f"{float(c['rate']):g}/s", (xi, yi), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("TPOT p50 (ms)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].set_title(f"{points[0]['target']}: throughput vs TPOT, a point a rate")
    axes[1].set_title(f"goodput under TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms" if slo
                      else "request throughput (no SLO: no goodput)")
    fig.tight_layout()
    return save_png(fig, path, dpi=120)


# --- comparing two cells ---------------------------------------------------------------------

def contract_of(bench: dict) -> dict:
    """What a cell measured: backend, batch, contract, versions and model hashes.

    Two cells are comparable only when these are all equal. A cell document missing any of
    them (or its stats) is malformed and raises, rather than comparing as "unknown == unknown".
    """
    if not isinstance(bench, dict):
        raise BenchError(f"cell document must be a dict, got {type(bench).__name__}")
    keys = _HTTP_KEYS if is_http(bench) else _CELL_KEYS  # an HTTP cell is its target's at its concurrency
    missing = [k for k in keys if k not in bench]
    if missing:
        raise BenchError(f"cell document missing {', '.join(missing)}")
    for key in ("contract", "versions", "model", "stats"):
        if not isinstance(bench[key], dict):
            raise BenchError(f"cell document {key!r} must be a dict, got {type(bench[key]).__name__}")
    return {**{k: bench[k] for k in keys[:2]}, **{k: dict(bench[k]) for k in ("contract", "versions", "model")}}


def throughput(stats_: dict) -> float:
    """A cell's tokens a second: an in-process cell's decode tok/s, an HTTP cell's output tok/s."""
    return float(stats_["decode_tok_s"] if "decode_tok_s" in stats_ else stats_["output_tok_s"])


def _refusals(current: dict, baseline: dict, names=("current", "baseline")) -> list[str]:
    return [f"{name} cell has no figure ({c['refused']})" for name, c in zip(names, (current, baseline))
            if isinstance(c, dict) and c.get("refused")]


def _noisy(cs: dict, bs: dict, names=("current", "baseline")) -> list[str]:
    return [f"{name} cell noisy ({s.get('noise_reason') or 'flagged noisy'})"
            for name, s in zip(names, (cs, bs)) if s.get("noisy", True)]


def _within_noise(pct: float, cs: dict, bs: dict) -> str | None:
    """Why a relative TPOT p50 difference makes no claim: it is no larger than the larger of the two spreads."""
    noise_ = max(float(cs["spread"]), float(bs["spread"]))
    if abs(pct) / 100.0 <= noise_:
        return f"difference within noise (|{pct:+.2f}%| <= spread {noise_ * 100:.2f}%)"
    return None


MACHINE = "machine differed"
"""In a claim's reason where the probes say the machine changed between the two runs (the views read it)."""


def probe_ratio(cs: dict, bs: dict) -> float | None:
    """The current cell's probe median over the baseline's (above 1: the machine was slower for the current cell);
    None where either cell has no probe."""
    if "probe_ms" not in cs or "probe_ms" not in bs:
        return None
    return float(cs["probe_ms"]) / float(bs["probe_ms"])


def _machine(ratio: float | None, cs: dict, bs: dict) -> str | None:
    """Why two runs' figures are not comparable though their cells are: the probe moved beyond PROBE_LIMIT."""
    if ratio is None or 1 / PROBE_LIMIT <= ratio <= PROBE_LIMIT:
        return None
    return (f"{MACHINE}: probe {_times(ratio)} in current ({float(cs['probe_ms']):.3f} vs {float(bs['probe_ms']):.3f} "
            f"ms, beyond {PROBE_LIMIT:g}x); load or clocks changed between the runs")


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x slower" if ratio >= 1 else f"{1 / ratio:.2f}x faster"


def alike(cs: dict, bs: dict) -> bool:
    """Whether two cells' stats were measured on a like machine: probes within PROBE_DRIFT (or either has none)."""
    ratio = probe_ratio(cs, bs)
    return ratio is None or 1 / (1 + PROBE_DRIFT) <= ratio <= 1 + PROBE_DRIFT


def _beyond_runs(pct: float, ratio: float | None, cs: dict, bs: dict) -> str | None:
    """Why a TPOT p50 change between two directories makes no claim: it is within the larger spread or the minimum
    effect (UNPROBED_EFFECT where a cell has no probe, which the reason says), after what the machine's change
    explains (the probe ratio to MACHINE_POWER, in its direction only: a faster machine explains no slow-down)."""
    spread = max(float(cs["spread"]), float(bs["spread"]))
    effect, why = MIN_EFFECT, ""
    if ratio is None:
        unprobed = " and ".join(n for n, st in (("current", cs), ("baseline", bs)) if "probe_ms" not in st)
        effect, why, ratio = UNPROBED_EFFECT, f" as the {unprobed} cell has no machine probe", 1.0
    bound, t, machine = max(spread, effect), 1 + pct / 100.0, ratio ** MACHINE_POWER
    if t >= 1:
        allowed, explained = (1 + bound) * max(machine, 1.0) - 1, machine > 1
    else:
        allowed, explained = 1 - (1 - bound) * min(machine, 1.0), machine < 1
    if abs(pct) / 100.0 <= allowed:
        by = f", times what the {MACHINE} by: (probe {_times(ratio)} in current) ** {MACHINE_POWER}"
        by = by if explained else ""
        return (f"difference within noise (|{pct:+.2f}%| <= {allowed * 100:.2f}%: the larger spread "
                f"{spread * 100:.2f}%, the minimum effect {effect * 100:.0f}%{why}{by})")
    return None


def no_claim(reason: str) -> dict:
    """A comparison of two cells that makes no directional claim, and why (directional_claim's fields)."""
    return {"claim": "no directional claim", "tpot_p50_change_pct": None, "tok_s_change_pct": None,
            "probe_ratio": None, "reason": reason}


def _differing_keys(a: dict, b: dict) -> list[str]:
    """Keys whose values differ, including keys present on one side only."""
    return sorted(str(k) for k in set(a) | set(b) if k not in a or k not in b or a[k] != b[k])


def _pct(current: float, baseline: float) -> float:
    return (current - baseline) / baseline * 100.0


def directional_claim(current: dict, baseline: dict) -> dict:
    """"faster"/"slower" on steady TPOT p50, or "no directional claim" with every reason.

    A claim needs (1) the same backend, batch, contract, versions and model hashes (HTTP cells: the same target
    and concurrency, and their streams as many tokens an event: side_by_side says why), (2) neither
    cell noisy, (3) the machine comparable: the two cells' probe medians within PROBE_LIMIT (`probe_ratio`, None
    where a cell has no probe), and (4) a TPOT p50 ratio beyond 1 + the larger of the two cells' spreads and
    MIN_EFFECT (UNPROBED_EFFECT without a probe), times what the machine's change explains (probe ratio **
    MACHINE_POWER, in its direction). The change percentages are
    (current - baseline) / baseline; a negative
    tpot_p50_change_pct means current is faster. They are reported whenever the two cells
    measured the same thing (even when noise blocks the claim, so a reader sees how small the
    difference was) and are None when they did not (a percentage between different experiments
    invites exactly the reading this function exists to prevent).
    """
    if refused := _refusals(current, baseline):
        return no_claim("; ".join(refused))
    a, b = contract_of(current), contract_of(baseline)
    reasons: list[str] = []
    for key in ("backend", "batch", "target", "concurrency"):
        if a.get(key) != b.get(key):
            reasons.append(f"{key} differs ({a.get(key)} vs {b.get(key)})")
    keys = _differing_keys(a["contract"], b["contract"])
    if keys:
        reasons.append(f"contract differs (keys {', '.join(keys)})")
    keys = _differing_keys(a["versions"], b["versions"])
    if keys:
        reasons.append(f"versions differ ({', '.join(keys)})")
    keys = _differing_keys(a["model"], b["model"])
    if keys:
        reasons.append(f"model differs ({', '.join(keys)})")
    comparable = not reasons

    if comparable and "target" in a:  # two HTTP cells: their servers may stream tokens in differently many events
        per_event = [round(tokens_per_event(c), 2) for c in (current, baseline)]
        if per_event[0] != per_event[1]:
            reasons.append(f"the streams' events carried {per_event[0]:.2f} and {per_event[1]:.2f} tokens each, so "
                           "vLLM's per-request TPOTs time different intervals")
    cs, bs = current["stats"], baseline["stats"]
    reasons += _noisy(cs, bs)
    ratio = probe_ratio(cs, bs)
    if ratio is not None and current.get("probe") != baseline.get("probe"):  # a changed workload times another thing
        reasons.append(f"the machine probes ran different workloads ({current.get('probe')} vs {baseline.get('probe')})")
    elif machine := _machine(ratio, cs, bs):
        reasons.append(machine)

    tpot_pct = tok_pct = None
    if comparable:
        cur_p50, base_p50 = float(cs["tpot"]["p50"]), float(bs["tpot"]["p50"])
        tpot_pct = _pct(cur_p50, base_p50)
        tok_pct = _pct(throughput(cs), throughput(bs))
        if not reasons and (within := _beyond_runs(tpot_pct, ratio, cs, bs)):
            reasons.append(within)

    out = {"tpot_p50_change_pct": tpot_pct, "tok_s_change_pct": tok_pct, "probe_ratio": ratio}
    if reasons:
        return {"claim": "no directional claim", **out, "reason": "; ".join(reasons)}
    return {"claim": "faster" if tpot_pct < 0 else "slower", **out, "reason": None}


def tokens_per_event(http: dict) -> float:
    """An HTTP cell's output tokens over its streamed events, every request of every round (1: an event a token)."""
    reqs = [q for r in http["repeats"] for q in r["requests"]]
    return sum(q["output_tokens"] for q in reqs) / max(1, sum(len(q["chunk_ms"]) for q in reqs))


def side_by_side(http: dict, inproc: dict) -> dict:
    """The builtin engine over HTTP beside the same engine in process (the in-process cell of batch = the
    concurrency, the same prompt contract): the ratios HTTP / in-process of TPOT p50 (vLLM's per-request TPOT over
    the steady decode step) and TTFT p50, and the HTTP ITL p50 over the in-process steady TPOT p50 (interval for
    interval), and the HTTP TPOT p99 over the in-process TPOT p50 (the slowest requests against the step);
    `slower`/`faster` (over HTTP) on the TPOT ratio only where the cells share SIDE_BY_SIDE_KEYS, the model and the
    versions, neither is noisy, the streams sent an event a token (or said how many tokens each carried) and the
    difference exceeds the larger spread. Ratios are given
    whenever the cells measured the same prompts and tokens, noisy or not, None otherwise."""
    out = {"tpot_p50_ratio": None, "ttft_p50_ratio": None, "itl_p50_over_tpot_p50": None, "tpot_p99_over_p50": None}
    if refused := _refusals(http, inproc, ("HTTP", "in-process")):
        return {**out, "claim": "no directional claim", "reason": "; ".join(refused)}
    a, b = contract_of(http), contract_of(inproc)
    reasons = []
    if keys := [k for k in SIDE_BY_SIDE_KEYS if a["contract"].get(k) != b["contract"].get(k)]:
        reasons.append(f"contract differs (keys {', '.join(keys)})")
    for what in ("model", "versions"):
        if keys := _differing_keys(a[what], b[what]):
            reasons.append(f"{what} differs ({', '.join(keys)})")
    comparable = not reasons
    hs, ps = http["stats"], inproc["stats"]
    reasons += _noisy(hs, ps, ("HTTP", "in-process"))
    counted = all(q.get("chunk_tokens") for r in http["repeats"] for q in r["requests"])
    if (per_event := tokens_per_event(http)) > 1 and not counted:  # counted: TPOT leaves the first event's tokens out
        # vLLM's TPOT counts from the first event: where that event carries k tokens, the k - 1 decode steps before
        # it fall in TTFT yet the rest is still divided by tokens - 1 (H200: 2.125 ms over HTTP "faster" than the
        # 2.193 ms step in process, with 1.8 tokens an event and an ITL p50 of 2.55 ms)
        reasons.append(f"HTTP events carried {per_event:.2f} tokens each (text held back until it completes), so "
                       "vLLM's per-request TPOT is not a decode interval")
    if comparable:
        tpot = float(ps["tpot"]["p50"])
        out = {"tpot_p50_ratio": float(hs["tpot"]["p50"]) / tpot,
               "ttft_p50_ratio": float(hs["ttft"]["p50"]) / float(ps["ttft"]["p50"]),
               "itl_p50_over_tpot_p50": float(hs["itl"]["p50"]) / tpot,
               # the slowest requests' time per token against the engine's step: steady under load (issue 66)
               "tpot_p99_over_p50": float(hs["tpot"]["p99"]) / tpot}
        if not reasons and (within := _within_noise((out["tpot_p50_ratio"] - 1) * 100, hs, ps)):
            reasons.append(within)
    if reasons:
        return {**out, "claim": "no directional claim", "reason": "; ".join(reasons)}
    return {**out, "claim": "slower" if out["tpot_p50_ratio"] > 1 else "faster", "reason": None}


def http_frame(http_cells: list[dict], pairs: dict[str, tuple[str, dict]]):
    """summary.csv's HTTP rows (HTTP_COLUMNS), in label order: each cell's percentiles and output tok/s (empty, with
    `refused`, where it has no figure) and, where `pairs` holds its in-process cell (label -> (that cell's label,
    side_by_side)), the side by side."""
    import pandas as pd

    rows = []
    for label, cell in sorted(((cell_label(c), c) for c in http_cells), key=lambda lc: label_key(lc[0])):
        s = cell.get("stats") or {}
        inproc, side = pairs.get(label, (None, {}))
        rows.append({
            "transport": OVER_HTTP, "target": cell["target"], "prompts": cell_prompts(cell),
            "concurrency": int(cell["concurrency"]),
            **{f"{m}_{q}_ms": (s.get(m) or {}).get(q) for m in HTTP_METRICS for q in ("p50", "p95", "p99")},
            "output_tok_s": s.get("output_tok_s"), "spread": s.get("spread"), "noisy": s.get("noisy"),
            "refused": cell.get("refused"), "inprocess_cell": inproc,
            "http_over_inprocess_tpot_p50": side.get("tpot_p50_ratio"),
            "http_over_inprocess_ttft_p50": side.get("ttft_p50_ratio"),
            "http_itl_p50_over_inprocess_tpot_p50": side.get("itl_p50_over_tpot_p50"),
            "http_tpot_p99_over_inprocess_tpot_p50": side.get("tpot_p99_over_p50"),
            "side_by_side_claim": side.get("claim"), "side_by_side_reason": side.get("reason"),
        })
    return pd.DataFrame(rows, columns=HTTP_COLUMNS)


def by_transport(frame):
    """summary.csv as (its in-process rows, its HTTP rows); a summary.csv without `transport` is in-process only."""
    if "transport" not in frame.columns:
        return frame, frame.iloc[0:0]
    http = frame["transport"] == OVER_HTTP
    return frame[~http].reset_index(drop=True), frame[http].reset_index(drop=True)


# --- table, markdown, plot -------------------------------------------------------------------

def summary_frame(cells: list[dict]):
    """One row per cell in FRAME_COLUMNS order, sorted by backend, prompt contract (workflow.runs: same-prompt
    first, then distinct-prompts), then batch; the floor columns from the cell's `floor` and `prefill_floor`
    (workflow.floor.bench_floor and prefill_floor; empty for a cell that predates them).

    Fails on no cells or on a repeated (backend, prompts, batch): either would make a table or a plot
    line that silently shows something other than one measurement per point.
    """
    import pandas as pd

    if not cells:
        raise BenchError("no cells to summarize")
    rows, seen = [], set()
    for cell in cells:
        for k in ("backend", "batch", "stats"):
            if k not in cell:
                raise BenchError(f"cell document missing {k}")
        key = (cell["backend"], cell_prompts(cell), cell["batch"])
        if key in seen:
            raise BenchError(f"duplicate cell backend={key[0]} prompts={key[1]} batch={key[2]}")
        seen.add(key)
        s = cell["stats"]
        fl, pf = cell.get("floor") or {}, cell.get("prefill_floor") or {}
        unique = fl.get("unique_experts") or {}
        rows.append({
            "backend": str(cell["backend"]),
            "prompts": key[1],
            "batch": int(cell["batch"]),
            "ttft_p50_ms": s["ttft"]["p50"],
            "first_decode_p50_ms": s["first_decode"]["p50"],
            "tpot_avg_ms": s["tpot"]["avg"],
            "tpot_p50_ms": s["tpot"]["p50"],
            "tpot_p95_ms": s["tpot"]["p95"],
            "tpot_p99_ms": s["tpot"]["p99"],
            "tpot_max_ms": s["tpot"]["max"],
            "tpot_count": int(s["tpot"]["count"]),
            "decode_tok_s": s["decode_tok_s"],
            "spread": s["spread"],
            "noisy": bool(s["noisy"]),
            # a compile's time, apart from the steady figures (cells of older evidence lack it)
            "first_warmup_over_repeat_s": cell.get("first_warmup_over_repeat_s"),
            "floor_ms": fl.get("floor_ms"), "floor_fraction": fl.get("floor_fraction"),
            "floor_MB": fl["bytes"]["total"] / 1e6 if fl.get("bytes") else None,
            "unique_experts_mean": unique.get("mean"), "unique_experts_min": unique.get("min"),
            "unique_experts_max": unique.get("max"),
            "prefill_floor_ms": pf.get("floor_ms"), "ttft_over_prefill_floor": pf.get("ttft_over_floor"),
        })
    frame = pd.DataFrame(rows, columns=FRAME_COLUMNS)
    same_first = lambda col: col.map(lambda v: v != SAME) if col.name == "prompts" else col  # noqa: E731
    return frame.sort_values(["backend", "prompts", "batch"], kind="mergesort", key=same_first).reset_index(drop=True)


def known(v) -> bool:
    return v is not None and v == v  # a CSV's empty field reads back as NaN


def markdown_table(frame) -> str:
    """The SUMMARY.md bench table, one row per cell, in the frame's order: each figure with its prompt contract
    (`same`, `distinct`) and its floor beside it (— where the cell has none)."""
    rows = [[str(r.backend), SHORT.get(r.prompts, str(r.prompts)), str(int(r.batch)),
             f"{r.tpot_p50_ms:.3f}", f"{r.tpot_avg_ms:.3f}", f"{r.tpot_p95_ms:.3f}", f"{r.decode_tok_s:.1f}",
             f"{r.floor_ms:.3f}" if known(r.floor_ms) else "—",
             f"{100 * r.floor_fraction:.0f}%" if known(r.floor_fraction) else "—",
             f"{r.unique_experts_mean:.1f} ({r.unique_experts_min:.0f}–{r.unique_experts_max:.0f})"
             if known(r.unique_experts_mean) else "—",
             "yes" if r.noisy else "no"]
            for r in frame.itertuples(index=False)]
    return markdown(MARKDOWN_HEADER, rows) + "\n"


NOISY = "noisy: no claim"
"""The plots' legend entry of a noisy cell's point (ringed)."""


def plot(frame, path: str | Path) -> Path:
    """Two panels (decode tok/s vs batch, steady TPOT p50 vs batch), one line per backend and prompt contract
    (a distinct-prompts line, dashed, is named `<backend> distinct`); a noisy cell's point is ringed in grey (NOISY).

    Uses a bare Figure on the Agg canvas (no pyplot global state, no backend switch for the
    rest of the process) and strips the PNG "Software" text chunk so the same frame always gives
    the same bytes; the file is written atomically.
    """
    from evident.workflow.core.plots import figure, save_png

    if len(frame) == 0:
        raise BenchError("nothing to plot")
    fig = figure(figsize=(10, 4))
    ax_tok, ax_tpot = fig.subplots(1, 2)
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    batches = sorted(int(b) for b in frame["batch"].unique())
    lines = frame.sort_values(["backend", "prompts", "batch"]).groupby(["backend", "prompts"], sort=True)
    for i, ((backend, prompts), group) in enumerate(lines):
        m = markers[i % len(markers)]
        name = str(backend) + ("" if prompts == SAME else f" {SHORT.get(prompts, prompts)}")
        style = "-" if prompts == SAME else "--"
        ax_tok.plot(group["batch"], group["decode_tok_s"], style, marker=m, label=name)
        ax_tpot.plot(group["batch"], group["tpot_p50_ms"], style, marker=m, label=name)
    noisy = frame[frame["noisy"].astype(bool)]
    for ax, col in ((ax_tok, "decode_tok_s"), (ax_tpot, "tpot_p50_ms")):
        if len(noisy):
            ax.scatter(noisy["batch"], noisy[col], s=150, facecolors="none", edgecolors="#57606a", linewidths=1.4,
                       zorder=5, label=NOISY)
    for ax, ylabel, title in (
        (ax_tok, "decode throughput (tokens/s)", "Decode throughput vs batch"),
        (ax_tpot, "steady TPOT p50 (ms/step)", "Steady TPOT p50 vs batch"),
    ):
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_xticks(batches)
        ax.grid(True, alpha=0.3)
        ax.legend(title="backend")
    fig.tight_layout()
    return save_png(fig, path, dpi=120)
