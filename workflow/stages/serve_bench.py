"""Stage `serve_bench`: the benchmark over HTTP, one target a job, a cell per concurrency and prompt contract.

A target (`bench.http.targets`, workflow.targets.bench_targets) is `engine`, the builtin engine through
`python -m evident.engine.serve` on the campaign's device, dtype and decode path (`bench.kernels`), or an `openai` entry of
`engines:` (its url, or its serve command started here). For each concurrency C of `bench.http.concurrency`:
`bench.warmup` warm-up rounds, then `bench.repeats` measured rounds, each of C streaming /v1/completions requests
sent at once (C threads released together), every one asking exactly `bench.new_tokens` tokens (max_tokens, and
vLLM's ignore_eos where the server takes it: `probe`; listed in `contract.request_extras` only where the server is
seen to honour it, `contract.ignore_eos` says what was found: `eos_probe`). The client times each request as vLLM's
`bench serve` does (workflow.benchstats.request_metrics: TTFT, ITL, TPOT, end-to-end latency) and counts its output
tokens from the stream's usage (or, where the server sends none, by the checkpoint's tokenizer, as vLLM does). The
prompt contracts are the in-process bench's: `bench.prompt` on every request, and where the campaign gives `bench.prompts`, request r
of a round sends prompts[r] (cells `http-<target>-distinct-c<C>`). A cell whose requests did not each give
new_tokens tokens, or did not stream them, is written with its raw requests and `refused` (why): no figure.
bench_report puts the builtin engine's cells beside its in-process cells. Before every measured round the in-process
bench's machine probe (workflow/bench/machine.py) is timed on the host's CPU (the client's and, here, the server's
host; `probe_ms`), for the claims between two directories.

Then the rate rung, a cell per rate R of `bench.http.rates` (`http-<target>-r<R>`): `bench.http.requests` requests of
`bench.prompt` sent at Poisson arrivals of R a second (seeded by `bench.http.seed`), whatever the server has answered
(vLLM's `bench serve --request-rate R --num-prompts N`), each timed as above or recorded with the error that ended it
(it counts as failed and misses the SLO; the stage goes on). The cell holds vLLM's figures (workflow.benchstats
summarize_rate: TTFT, TPOT, ITL, E2E percentiles, request throughput, output tok/s) and goodput under
`bench.http.slo`; the target's plot (plots/rates-<target>.png) sets each rate's throughput and goodput against its
TPOT p50. The client (workflow/bench/load.py) is the soak stage's too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from evident.workflow.bench import machine
from evident.workflow.bench.benchstats import (HTTP_METRICS, BenchError, measured_with, rate_plot, summarize_http,
                                               summarize_rate)
from evident.workflow.bench.load import extras, poisson_offsets, round_of, started_here, sweep, target_url
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args
from evident.workflow.models import checkpoints
from evident.workflow.plan import environment, targets
from evident.workflow.plan.runs import SAME, SHORT, bench_contracts, http_cell, prompt_keys, prompt_texts, rate_cell

def contract(bench: dict, texts: list[str], tok: Tokenizer, prompts: str, concurrency: int, extra: dict,
             dtype: str, device: str | None, eos: str = "refused") -> dict:
    """What a cell measured, with the in-process bench's prompt keys (workflow.stages.bench), so that the builtin
    engine's cells stand beside its in-process ones (benchstats.SIDE_BY_SIDE_KEYS). `request_extras`: those sent
    that the server honours (ignore_eos only where `eos`, eos_probe's finding or `refused`, is `honoured`)."""
    ids = [tok.encode(t).ids for t in texts]  # as engine.serve and the in-process bench encode a text prompt
    return {"prompts": prompts, **prompt_keys(texts, ids, prompts), "new_tokens": bench["new_tokens"], "warmup": bench["warmup"],
            "repeats": bench["repeats"], "concurrency": concurrency, **request_keys(extra, eos),
            "dtype": dtype, "device": device}


def request_keys(extra: dict, eos: str) -> dict:
    """How every request of a cell was sent and timed."""
    return {"api": "/v1/completions, stream: true, greedy",
            "request_extras": sorted(k for k in extra if k != "ignore_eos" or eos == "honoured"), "ignore_eos": eos,
            "timer": "perf_counter on the client, at each server-sent event"}


def bench_cell(client: targets.Client, bench: dict, texts: list[str], prompts: str, extra: dict, tok: Tokenizer,
               log) -> dict:
    """Warm-up and measured rounds of one cell, and its statistics (None, with `refused`, where it has none)."""
    concurrency = len(texts)
    bodies = [{"prompt": t, "max_tokens": bench["new_tokens"], **extra} for t in texts]
    with ThreadPoolExecutor(concurrency) as pool:
        machine.probe_ms("cpu")  # its first run pays for the allocations
        warmups = [round_of(pool, client, bodies, tok)["duration_ms"] for _ in range(bench["warmup"])]
        repeats = []
        for r in range(bench["repeats"]):
            probe = machine.probe_ms("cpu")
            repeats.append({**round_of(pool, client, bodies, tok), "probe_ms": probe})
            log(f"c{concurrency} {SHORT[prompts]}: round {r + 1}/{bench['repeats']} {repeats[-1]['duration_ms']:.1f} ms")
    try:
        stats, refused = summarize_http(repeats, concurrency, bench["new_tokens"]), None
    except BenchError as e:
        stats, refused = None, str(e)
        log(f"c{concurrency} {SHORT[prompts]}: no figure: {refused}")
    return {"repeats": repeats, "warmup_duration_ms": warmups, "stats": stats, "refused": refused,
            "probe": machine.WORKLOAD}


def rate_cell_of(client: targets.Client, bench: dict, rate: float, extra: dict, eos: str, tok: Tokenizer,
                 dtype: str, device: str | None) -> dict:
    """One rate of the rate rung: bench.http.requests requests of bench.prompt at Poisson arrivals (seeded), each
    recorded as load.sweep records it, and vLLM's figures (benchstats.summarize_rate)."""
    http = bench["http"]
    ids = [tok.encode(bench["prompt"]).ids]
    done = sweep(client, {"prompt": bench["prompt"], "max_tokens": bench["new_tokens"], **extra},
                 poisson_offsets(rate, http["seed"], n=http["requests"]), tok)
    return {"contract": {"prompts": SAME, **prompt_keys([bench["prompt"]], ids, SAME), "new_tokens": bench["new_tokens"],
                         "rate": rate, "requests": http["requests"], "arrivals": "poisson", "seed": http["seed"],
                         "slo": http["slo"], **request_keys(extra, eos), "dtype": dtype, "device": device},
            "requests": done["requests"], "duration_ms": done["duration_ms"],
            "stats": summarize_rate(done["requests"], done["duration_ms"], bench["new_tokens"], http["slo"])}


def run(ckpt: Path, evidence: Path, spec: dict) -> None:
    config = read_config(evidence / layout.CONFIG)
    bench, name, kind = config["bench"], spec["name"], spec["kind"]
    http = bench["http"]
    device = environment.resolve_device(config["device"])
    dtype = spec.get("dtype") or config["dtype"]
    builtin = kind == targets.BUILTIN
    where = device if started_here(spec) else None  # a url's server runs wherever it runs
    params = {"target": name, "kind": kind, "concurrency": http["concurrency"], "rates": http["rates"], "dtype": dtype,
              "device": where, **({"kernels": bench["kernels"]} if builtin else {})}
    with Stage(evidence, f"serve_bench-{name}", params=params) as st:
        checkpoints.verify(ckpt, read_json(evidence / layout.CHECKPOINT))
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        versions, model = measured_with(evidence)
        server_log = evidence / layout.log(f"serve_bench-{name}-server")

        def log(msg: str) -> None:
            print(f"[serve_bench {name}] {msg}", flush=True)

        t0 = time.perf_counter()
        with target_url(spec, ckpt, dtype, device, bench["kernels"], server_log) as base:
            client = targets.Client(base).connect()
            ready_s = time.perf_counter() - t0
            extra, eos = extras(client, [bench["prompt"], *(bench.get("prompts") or [])], bench["new_tokens"])
            log(f"{'started' if started_here(spec) else 'at its url'}, ready after {ready_s:.1f}s; "
                f"request extras: {sorted(extra) or 'none'}; ignore_eos {eos}")
            common = {"target": name, "kind": kind, **({"kernels": bench["kernels"]} if builtin else {}), "dtype": dtype,
                      "device": where}
            server = {"ready_s": round(ready_s, 3), "model": targets.model_id(client.model),
                      "started": "here" if started_here(spec) else "url"}
            for prompts in bench_contracts(bench):
                for c in http["concurrency"]:
                    texts = prompt_texts(bench, c, prompts)
                    cell = bench_cell(client, bench, texts, prompts, extra, tok, log)
                    label = http_cell(name, c, prompts)
                    st.write_json(layout.bench_cell(label), {
                        **common, "concurrency": c,
                        "contract": contract(bench, texts, tok, prompts, c, extra, dtype, where, eos),
                        "server": server, **cell, "versions": versions, "model": model})
                    if (s := cell["stats"]) is not None:
                        key = f"c{c}" if prompts == SAME else f"distinct_c{c}"
                        st.metrics.update({f"{key}_{m}_p50_ms": s[m]["p50"] for m in HTTP_METRICS})
                        st.metrics[f"{key}_output_tok_s"] = s["output_tok_s"]
                        log(f"{label}: TTFT p50 {s['ttft']['p50']:.2f} ms, TPOT p50 {s['tpot']['p50']:.3f} ms, "
                            f"ITL p50 {s['itl']['p50']:.3f} ms, {s['output_tok_s']:.1f} output tok/s"
                            + (f" (noisy: {s['noise_reason']})" if s["noisy"] else ""))
            rated = []
            for rate in http["rates"]:
                cell = {**common, "rate": rate, **rate_cell_of(client, bench, rate, extra, eos, tok, dtype, where),
                        "server": server, "versions": versions, "model": model}
                st.write_json(layout.bench_cell(rate_cell(name, rate)), cell)
                rated.append(cell)
                s, key = cell["stats"], f"r{float(rate):g}"
                st.metrics.update({f"{key}_request_throughput": s["request_throughput"],
                                   f"{key}_output_tok_s": s["output_tok_s"], f"{key}_failed": s["failed"],
                                   **({f"{key}_goodput": s["goodput"]} if s["goodput"] is not None else {}),
                                   **{f"{key}_{m}_p50_ms": s[m]["p50"] for m in HTTP_METRICS if s[m]}})
                log(f"{rate_cell(name, rate)}: {s['completed']}/{s['requests']} completed in {s['duration_s']:.2f} s, "
                    f"{s['request_throughput']:.2f} req/s, {s['output_tok_s']:.1f} output tok/s"
                    + (f", TPOT p50 {s['tpot']['p50']:.3f} ms" if s["tpot"] else "")
                    + (f", goodput {s['goodput']:.2f} req/s ({s['good']} good)" if s["goodput"] is not None else ""))
        if rated:
            try:
                rate_plot(rated, evidence / layout.rate_plot(name))
            except BenchError as e:  # no rate completed a request: the cells say why, the plot has no point
                log(f"no rate plot: {e}")
            else:
                st.add_file(evidence / layout.rate_plot(name))
        if server_log.is_file():
            st.add_file(server_log)


def main(argv: list[str] | None = None) -> None:
    ap: argparse.ArgumentParser = stage_args(__doc__, checkpoint=True)
    ap.add_argument("--spec", required=True, type=json.loads,
                    help=f'the target: {{"name": "{targets.ENGINE}", "kind": "{targets.BUILTIN}"}} or an `engines:` entry of '
                         "kind openai, as JSON")
    args = ap.parse_args(argv)
    try:
        run(args.checkpoint, args.evidence, args.spec)
    except (targets.TargetError, checkpoints.CheckpointInvalid, OSError) as e:
        sys.exit(f"[serve_bench {args.spec.get('name')}] error: {e}")


if __name__ == "__main__":
    main()
