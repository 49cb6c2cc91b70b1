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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from evident.workflow.bench import machine
from evident.workflow.bench.benchstats import HTTP_METRICS, BenchError, measured_with, summarize_http
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args
from evident.workflow.models import checkpoints
from evident.workflow.plan import environment, targets
from evident.workflow.plan.runs import SAME, SHORT, bench_contracts, http_cell, prompt_keys, prompt_texts

USAGE = {"stream_options": {"include_usage": True}}
# what a request adds to OpenAI's fields, best first: the first the server takes is used for every request
EXTRAS = ({"ignore_eos": True, **USAGE}, USAGE, {})
BARRIER_S = 60  # a round's threads wait at most this long for each other


@contextlib.contextmanager
def target_url(spec: dict, ckpt: Path, dtype: str, device: str, kernels: str, log: Path):
    """The target's base URL: the builtin engine's server started here, or the `openai` entry's url or server."""
    if spec["kind"] == targets.BUILTIN:
        with targets.engine_server(ckpt, device, dtype, log, kernels=kernels) as (base, _):
            yield base
    else:
        with targets.endpoint(spec, ckpt, dtype, device, log) as base:
            yield base


def probe(client: targets.Client, prompt: str) -> dict:
    """The extras the server takes (EXTRAS, best first), found with one short untimed streaming request: a 4xx
    answers no, a 5xx is an error."""
    def probe(extra: dict) -> dict:
        for _ in client.stream({"prompt": prompt, "max_tokens": 2, **extra}):
            pass
        return extra

    for extra in EXTRAS[:-1]:
        try:
            return probe(extra)
        except targets.ServerError as e:
            if e.status >= 500:
                raise
    return probe(EXTRAS[-1])  # none: an error now is the server's


def stopped_early(client: targets.Client, body: dict) -> bool | None:
    """Whether a streamed completion ended before its max_tokens: its usage's token count, else its last
    finish_reason (`stop`: no stop strings are sent, so an EOS); None where the stream says neither."""
    finish, tokens = None, None
    for _, event in client.stream(body):
        for choice in event.get("choices") or []:
            finish = choice.get("finish_reason") or finish
        if (n := (event.get("usage") or {}).get("completion_tokens")) is not None:
            tokens = int(n)
    if tokens is not None:
        return tokens < body["max_tokens"]
    return {"stop": True, "length": False}.get(finish)


def eos_probe(client: targets.Client, extra: dict, texts: list[str], max_tokens: int) -> str:
    """Whether a server that takes ignore_eos honours it (llama.cpp's accepts it and stops at EOS anyway): a prompt
    of the contract's that stops early without it must reach max_tokens with it. `honoured`, `ignored` (it stopped
    early with it too), or `unverified` (no prompt of the contract met EOS within max_tokens without it, or the
    stream said neither how many tokens nor why it ended)."""
    plain = {k: v for k, v in extra.items() if k != "ignore_eos"}
    for text in dict.fromkeys(texts):
        body = {"prompt": text, "max_tokens": max_tokens, **plain}
        if stopped_early(client, body):
            with_it = stopped_early(client, {**body, "ignore_eos": True})
            return {True: "ignored", False: "honoured"}.get(with_it, "unverified")
    return "unverified"


def one_request(client: targets.Client, body: dict, start: Callable[[], float], tok: Tokenizer,
                delay_s: float = 0.0) -> dict:
    """One streamed request, sent delay_s after its round's start (`start()` waits until every thread of the round is
    ready and returns that moment): each event that carries a choice, in ms after sending (`chunk_ms`), and its output
    tokens (`counted_by`: the server's usage, else the tokenizer)."""
    time.sleep(max(0.0, start() + delay_s - time.perf_counter()))  # one schedule: threads leave a barrier unevenly
    sent = time.perf_counter()
    chunks, texts, usage = [], [], None
    for at, event in client.stream(body):
        if "error" in event:
            raise targets.TargetError(f"the server sent an error in its stream: {json.dumps(event['error'])[:300]}")
        if choices := event.get("choices"):
            chunks.append((at - sent) * 1e3)
            texts.append(choices[0].get("text") or "")
        if (event.get("usage") or {}).get("completion_tokens") is not None:
            usage = int(event["usage"]["completion_tokens"])
    end = time.perf_counter()
    counted = {"output_tokens": usage, "counted_by": "usage"} if usage is not None else {
        "output_tokens": len(tok.encode("".join(texts), add_special_tokens=False).ids), "counted_by": "tokenizer"}
    return {"chunk_ms": chunks, **counted, "sent": sent, "end": end}


def round_of(pool: ThreadPoolExecutor, client: targets.Client, bodies: list[dict], tok: Tokenizer,
             gap_s: float = 0.0) -> dict:
    """len(bodies) requests at once (or request r gap_s * r after the first): each as one_request records it, and the
    round's duration (first sent to last stream's end)."""
    t0 = []
    ready = threading.Barrier(len(bodies), action=lambda: t0.append(time.perf_counter()))

    def start() -> float:
        ready.wait(BARRIER_S)
        return t0[0]

    reqs = list(pool.map(lambda rb: one_request(client, rb[1], start, tok, gap_s * rb[0]), enumerate(bodies)))
    duration = (max(r.pop("end") for r in reqs) - min(r["sent"] for r in reqs)) * 1e3
    for r in reqs:
        r.pop("sent")
    return {"duration_ms": duration, "requests": reqs}


def contract(bench: dict, texts: list[str], tok: Tokenizer, prompts: str, concurrency: int, extra: dict,
             dtype: str, device: str | None, eos: str = "refused") -> dict:
    """What a cell measured, with the in-process bench's prompt keys (workflow.stages.bench), so that the builtin
    engine's cells stand beside its in-process ones (benchstats.SIDE_BY_SIDE_KEYS). `request_extras`: those sent
    that the server honours (ignore_eos only where `eos`, eos_probe's finding or `refused`, is `honoured`)."""
    ids = [tok.encode(t).ids for t in texts]  # as engine.serve and the in-process bench encode a text prompt
    return {"prompts": prompts, **prompt_keys(texts, ids, prompts), "new_tokens": bench["new_tokens"], "warmup": bench["warmup"],
            "repeats": bench["repeats"], "concurrency": concurrency, "api": "/v1/completions, stream: true, greedy",
            "request_extras": sorted(k for k in extra if k != "ignore_eos" or eos == "honoured"), "ignore_eos": eos,
            "timer": "perf_counter on the client, at each server-sent event",
            "dtype": dtype, "device": device}


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


def run(ckpt: Path, evidence: Path, spec: dict) -> None:
    config = read_config(evidence / layout.CONFIG)
    bench, name, kind = config["bench"], spec["name"], spec["kind"]
    device = environment.resolve_device(config["device"])
    dtype = spec.get("dtype") or config["dtype"]
    builtin = kind == targets.BUILTIN
    where = device if builtin or "serve" in spec else None  # a url's server runs wherever it runs
    params = {"target": name, "kind": kind, "concurrency": bench["http"]["concurrency"], "dtype": dtype,
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
            extra = probe(client, bench["prompt"])
            eos = "refused"
            if "ignore_eos" in extra:
                contract_texts = [bench["prompt"], *(bench.get("prompts") or [])]
                eos = eos_probe(client, extra, contract_texts, bench["new_tokens"])
                if eos == "ignored":  # not sent: it does nothing there
                    extra = {k: v for k, v in extra.items() if k != "ignore_eos"}
            log(f"{'started' if builtin or 'serve' in spec else 'at its url'}, ready after {ready_s:.1f}s; "
                f"request extras: {sorted(extra) or 'none'}; ignore_eos {eos}")
            for prompts in bench_contracts(bench):
                for c in bench["http"]["concurrency"]:
                    texts = prompt_texts(bench, c, prompts)
                    cell = bench_cell(client, bench, texts, prompts, extra, tok, log)
                    label = http_cell(name, c, prompts)
                    st.write_json(layout.bench_cell(label), {
                        "target": name, "kind": kind, "concurrency": c,
                        **({"kernels": bench["kernels"]} if builtin else {}), "dtype": dtype, "device": where,
                        "contract": contract(bench, texts, tok, prompts, c, extra, dtype, where, eos),
                        "server": {"ready_s": round(ready_s, 3), "model": targets.model_id(client.model),
                                   "started": "here" if builtin or "serve" in spec else "url"},
                        **cell, "versions": versions, "model": model})
                    if (s := cell["stats"]) is not None:
                        key = f"c{c}" if prompts == SAME else f"distinct_c{c}"
                        st.metrics.update({f"{key}_{m}_p50_ms": s[m]["p50"] for m in HTTP_METRICS})
                        st.metrics[f"{key}_output_tok_s"] = s["output_tok_s"]
                        log(f"{label}: TTFT p50 {s['ttft']['p50']:.2f} ms, TPOT p50 {s['tpot']['p50']:.3f} ms, "
                            f"ITL p50 {s['itl']['p50']:.3f} ms, {s['output_tok_s']:.1f} output tok/s"
                            + (f" (noisy: {s['noise_reason']})" if s["noisy"] else ""))
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
