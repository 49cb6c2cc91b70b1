"""The load client the HTTP stages share (serve_bench, soak): the target's server (`target_url`), what it takes
(`probe`, `eos_probe`), one streamed request timed as vLLM's `bench serve` times it (`stream_request`), a round of
requests at once (`round_of`: the concurrency cells), Poisson arrivals (`poisson_offsets`) and an open-loop sweep of
them (`sweep`: the rate rung and the soak).

A request is timed on the client: each server-sent event that carries a choice, in ms after sending (`chunk_ms`), the
tokens each carried where every event says (`chunk_tokens`, from usage.completion_tokens: vLLM's
continuous_usage_stats, so that benchstats.request_metrics knows an event of several tokens), and its output tokens
(`counted_by`: the server's usage, else the checkpoint's tokenizer, as vLLM counts). In a sweep, a request that fails
is recorded with its `error` and the sweep goes on: a server's failures are evidence, not the client's crash.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from evident.workflow.plan import targets

USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
PLAIN_USAGE = {"stream_options": {"include_usage": True}}  # for a server that refuses continuous_usage_stats
# what a request adds to OpenAI's fields, best first: the first the server takes is used for every request
EXTRAS = ({"ignore_eos": True, **USAGE}, {"ignore_eos": True, **PLAIN_USAGE}, USAGE, PLAIN_USAGE, {})
BARRIER_S = 60  # a round's threads wait at most this long for each other
PROGRESS_S = 10.0  # a long sweep's progress line, at most this often
MAX_IN_FLIGHT = 256  # a sweep's requests in flight at most: a later one is sent late (`sent_ms` says how late)
# what one request of a sweep may end with, recorded as its error: an error status or a bad event (TargetError), a
# refused, reset or timed-out connection (OSError), a stream cut short (HTTPException), a reply that is not JSON
FAILED = (targets.TargetError, OSError, http.client.HTTPException, ValueError)


@contextlib.contextmanager
def target_url(spec: dict, ckpt: Path, dtype: str, device: str, kernels: str, log: Path):
    """The target's base URL: the builtin engine's server started here, or the `openai` entry's url or server."""
    if spec["kind"] == targets.BUILTIN:
        with targets.engine_server(ckpt, device, dtype, log, kernels=kernels) as (base, _):
            yield base
    else:
        with targets.endpoint(spec, ckpt, dtype, device, log) as base:
            yield base


def started_here(spec: dict) -> bool:
    """Whether the target's server runs here (the builtin engine's, a `serve` entry's), not at a url."""
    return spec["kind"] == targets.BUILTIN or "serve" in spec


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


def extras(client: targets.Client, prompts: list[str], max_tokens: int) -> tuple[dict, str]:
    """(the extras every request sends, what eos_probe found: `refused` where the server takes no ignore_eos).
    ignore_eos is not sent where the server ignores it: it does nothing there."""
    extra, eos = probe(client, prompts[0]), "refused"
    if "ignore_eos" in extra:
        eos = eos_probe(client, extra, prompts, max_tokens)
        if eos == "ignored":
            extra = {k: v for k, v in extra.items() if k != "ignore_eos"}
    return extra, eos


def stream_request(client: targets.Client, body: dict, tok: Tokenizer) -> dict:
    """One streamed request, sent now: `chunk_ms`, `chunk_tokens` (where every event carried a usage count),
    `finish_reason` (its last choice's), `output_tokens` and `counted_by`, and its `sent` and `end` (perf_counter)."""
    sent = time.perf_counter()
    chunks, texts, counts, usage, finish = [], [], [], None, None
    for at, event in client.stream(body):
        if "error" in event:
            raise targets.TargetError(f"the server sent an error in its stream: {json.dumps(event['error'])[:300]}")
        n = (event.get("usage") or {}).get("completion_tokens")
        if choices := event.get("choices"):
            chunks.append((at - sent) * 1e3)
            texts.append(choices[0].get("text") or "")
            counts.append(None if n is None else int(n))
            finish = choices[0].get("finish_reason") or finish
        if n is not None:
            usage = int(n)
    end = time.perf_counter()
    out = {"chunk_ms": chunks, "finish_reason": finish}
    if counts and None not in counts:  # cumulative on every event: each event's own tokens
        out["chunk_tokens"] = np.diff([0, *counts]).tolist()
    counted = {"output_tokens": usage, "counted_by": "usage"} if usage is not None else {
        "output_tokens": len(tok.encode("".join(texts), add_special_tokens=False).ids), "counted_by": "tokenizer"}
    return {**out, **counted, "sent": sent, "end": end}


def one_request(client: targets.Client, body: dict, start: Callable[[], float], tok: Tokenizer,
                delay_s: float = 0.0) -> dict:
    """One streamed request of a round, sent delay_s after the round's start (`start()` waits until every thread of
    the round is ready and returns that moment): as stream_request records it."""
    time.sleep(max(0.0, start() + delay_s - time.perf_counter()))  # one schedule: threads leave a barrier unevenly
    return stream_request(client, body, tok)


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


def poisson_offsets(rate: float, seed: int, n: int | None = None, duration_s: float | None = None) -> list[float]:
    """When each request of a Poisson process of `rate` a second is sent, in seconds after the first (0): `n`
    requests, or those before `duration_s`. The gaps are exponential draws of a generator seeded with `seed`, the same
    draws at every rate scaled by 1 / rate (vLLM's bench serve draws its gaps from a gamma of shape 1, the same)."""
    rng, out, at = np.random.default_rng(seed), [], 0.0
    while (n is None or len(out) < n) and (duration_s is None or at < duration_s):
        out.append(at)
        at += float(rng.exponential(1.0)) / rate
    return out


def sweep(client: targets.Client, body: dict, offsets_s: list[float], tok: Tokenizer,
          stop: threading.Event | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """An open loop: request i sent offsets_s[i] after the sweep's start, whatever the server has answered (vLLM's
    bench serve at a --request-rate). Each request as stream_request records it, in ms from the sweep's start
    (`scheduled_ms`, `sent_ms`, `end_ms`), or with the `error` that ended it; none is sent once `stop` is set (a
    server that died: `unsent` counts them). `duration_ms`: the start to the last request's end. `progress`, if
    given, gets a line every PROGRESS_S while requests are sent."""
    t0, futures = time.perf_counter(), []
    last = t0

    def timed(at: float) -> dict:
        sent = time.perf_counter()
        try:
            rec = stream_request(client, body, tok)
            rec.pop("sent")
            end = rec.pop("end")
            if rec["finish_reason"] is None:  # every last choice names why it ended: this stream was cut short
                rec["error"] = "the stream ended with no finish_reason: cut short (the server died or dropped it)"
        except FAILED as e:
            rec, end = {"error": f"{type(e).__name__}: {str(e)[:300]}"}, time.perf_counter()
        return {"scheduled_ms": at * 1e3, "sent_ms": (sent - t0) * 1e3, "end_ms": (end - t0) * 1e3, **rec}

    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        for at in offsets_s:
            wait = t0 + at - time.perf_counter()
            if stop is not None and (stop.wait(wait) if wait > 0 else stop.is_set()):
                break
            if wait > 0 and stop is None:
                time.sleep(wait)
            futures.append(pool.submit(timed, at))
            if progress is not None and (now := time.perf_counter()) - last >= PROGRESS_S:
                last, ended = now, [f.result() for f in futures if f.done()]
                progress(f"{now - t0:.0f} s: {len(futures)} of {len(offsets_s)} requests sent, {len(ended)} ended, "
                         f"{sum('error' in r for r in ended)} failed")
        reqs = [f.result() for f in futures]
    duration = max((r["end_ms"] for r in reqs), default=(time.perf_counter() - t0) * 1e3)
    return {"duration_ms": duration, "requests": reqs, "unsent": len(offsets_s) - len(reqs)}
