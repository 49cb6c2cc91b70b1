"""An OpenAI-compatible HTTP endpoint over the engine: ``/v1/completions`` and ``/v1/models``.

    python -m engine.serve --checkpoint DIR [--backend single] [--device cpu] [--dtype float32] --port P
        [--max-batch 8] [--batch-window-ms 2]

Greedy only (``temperature`` 0; anything else is a 400), the engine's own ``generate``. ``prompt`` is a string, a
list of strings, a list of token ids or a list of such lists (one choice per prompt; a string gets the tokenizer's
special tokens, ids are taken as they are). ``logprobs`` k (at most ``MAX_LOGPROBS``) returns, per token, its
log-prob and the top k (plus the token itself, as OpenAI), from the float32 log-softmax of the very logits its
token was picked from; ``echo`` puts the prompt before the completion and, with ``logprobs``, the prompt's
teacher-forced log-probs (``generate.forced``; the first token's is null); ``return_tokens_as_token_ids`` (vLLM's)
names tokens ``token_id:<id>``. ``usage`` counts tokens, in a stream too with ``stream_options.include_usage``.

Static batching: one worker thread owns the model. A request's prompts are rows; the worker takes what has arrived
within ``--batch-window-ms`` of the first row (or what queued while the last batch decoded), up to ``--max-batch``
rows whose prompt lengths plus the batch's largest ``max_tokens`` fit the context, and decodes them as one
``generate`` call. Ragged prompts need no padding: each row is prefilled alone into its own cache row and decodes at
its own position (the cache keeps a length per row), so a row gets the tokens it gets alone. Every unfinished row
advances in one batched step; each stops at its own ``max_tokens``, EOS or stop string and is answered then. A row
arriving meanwhile waits for the next batch, which starts when the longest row ends. Not continuous batching, on
purpose: ``generate`` is the decode loop that parity and the bench measure (the graph path's too), with a cache
sized to its batch; rows joining mid-batch would need a second loop and a full-context cache row for every slot.

Stop strings are applied to the decoded text: the completion ends before the first stop string, and generation
stops as soon as one appears (log-probs still cover every generated token, as vLLM's). ``stream: true`` sends
server-sent events (``data: {...}``, then ``data: [DONE]``), holding back any text that could still turn into a
stop string. Bad requests get a 4xx with an OpenAI-style JSON error naming the field. Binds 127.0.0.1 unless
``--host`` says otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from .generate import MAX_BATCH, forced, generate

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
WINDOW_S = 0.002  # how long an idle worker waits for more rows after the first


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int = Field(16, ge=0)
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False
    stream_options: dict | None = None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def stop_index(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string (not safe to send yet)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


def _entry(logprobs: torch.Tensor, token: int, k: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(token, its log-prob, the top k (id, log-prob), best first) from one position's log-softmax [vocab]."""
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return token, logprobs[token].item(), list(zip(top.indices.tolist(), top.values.tolist()))


@dataclass(eq=False)
class Job:
    """One prompt of a request, a row of a batch. The worker puts (index, kind, value) on ``out``: ("text", delta)
    while it decodes (``stream`` only: text no stop string can start in any more), then ("done", None) as soon as
    the row ends, or ("error", message)."""
    index: int
    ids: list[int]
    max_tokens: int
    stops: list[str]
    logprobs: int | None  # top k per token; None: no log-probs
    echo: bool
    stream: bool
    out: queue.Queue
    text: str = ""
    sent: int = 0
    stopped: bool = False
    tokens: list[int] = field(default_factory=list)
    entries: list = field(default_factory=list)  # _entry per token (echo: the prompt's first, its first one null)
    last: torch.Tensor | None = None  # the log-softmax the row's next token is picked from
    finish: str | None = None  # set when the row is done


class Engine:
    """The loaded engine and its batching worker, the one thread that runs the model."""

    def __init__(self, model, tokenizer: Tokenizer, eos: list[int], model_id: str, max_batch: int = MAX_BATCH,
                 window_s: float = WINDOW_S):
        self.model, self.tok, self.eos, self.model_id = model, tokenizer, eos, model_id
        self.max_batch, self.window_s = max_batch, window_s
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, daemon=True, name="batcher").start()

    def prompts(self, prompt, max_tokens: int) -> list[tuple[list[int], str]]:
        """A request's prompts as (token ids, text), each checked against the vocabulary and the context."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise BadRequest("prompt: no prompt given", "prompt")
        vocab, limit = self.model.args.vocab_size, self.model.args.max_position_embeddings
        out = []
        for i, p in enumerate(prompt):
            ids = self.tok.encode(p).ids if isinstance(p, str) else list(p)  # a string: BOS as the oracle adds it
            if not ids:
                raise BadRequest(f"prompt {i} has no tokens", "prompt")
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise BadRequest(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
            if len(ids) + max_tokens > limit:
                raise BadRequest(f"prompt {i}: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                                 f"context of {limit} tokens", "max_tokens")
            out.append((ids, p if isinstance(p, str) else self.tok.decode(ids, skip_special_tokens=True)))
        return out

    def submit(self, jobs: list[Job]) -> None:
        for j in jobs:
            self.queue.put(j)

    # --- the worker ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        waiting: list[Job] = []
        while True:
            if not waiting:  # idle: the first row opens a window for the rows that come with it
                waiting.append(self.queue.get())
                deadline = time.monotonic() + self.window_s
                while len(waiting) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                    try:
                        waiting.append(self.queue.get(timeout=left))
                    except queue.Empty:
                        break
            while len(waiting) < self.max_batch:  # and what queued while the last batch decoded
                try:
                    waiting.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            batch: list[Job] = []
            for j in waiting:  # in arrival order, while the rows fit one cache
                if len(batch) < self.max_batch and self._fits(batch + [j]):
                    batch.append(j)
            waiting = [j for j in waiting if j not in batch]
            self._run(batch)

    def _fits(self, jobs: list[Job]) -> bool:
        """generate decodes every row up to the batch's largest max_tokens: each prompt must leave room for it."""
        rows = [j for j in jobs if j.max_tokens]
        return not rows or max(len(j.ids) for j in rows) + max(j.max_tokens for j in rows) <= \
            self.model.args.max_position_embeddings

    def _run(self, batch: list[Job]) -> None:
        try:
            for j in batch:
                if j.echo and j.logprobs is not None:
                    j.entries = self._prompt_entries(j)
                if not j.max_tokens:
                    self._done(j, [])
            if rows := [j for j in batch if j.max_tokens]:
                generate(self.model, [j.ids for j in rows], max(j.max_tokens for j in rows), self.eos,
                         stop=lambda r, toks: self._emitted(rows[r], toks),
                         observe=lambda idx, logits: self._observe([rows[r] for r in idx], logits))
        except Exception as e:  # noqa: BLE001 - reported to every request of the batch still waiting
            for j in batch:
                if j.finish is None:
                    j.out.put((j.index, "error", f"{type(e).__name__}: {e}"))

    def _done(self, job: Job, toks: list[int]) -> None:
        """A row's answer, sent as soon as the row ends, while the rest of its batch decodes on."""
        job.tokens = list(toks)
        job.finish = "stop" if job.stopped or (toks and toks[-1] in self.eos) else "length"
        if job.stream and len(job.text) > job.sent:
            job.out.put((job.index, "text", job.text[job.sent:]))
        job.out.put((job.index, "done", None))

    def _prompt_entries(self, job: Job) -> list:
        """The prompt's teacher-forced log-probs: position p - 1 predicts token p; the first token has none."""
        seen = []
        forced(self.model, [job.ids], [[]], lambda logits: seen.append(torch.log_softmax(logits[0].float(), -1)))
        return [(job.ids[0], None, None)] + [_entry(seen[0][p - 1], job.ids[p], job.logprobs)
                                             for p in range(1, len(job.ids))]

    @staticmethod
    def _observe(jobs: list[Job], logits: torch.Tensor) -> None:
        if any(j.logprobs is not None for j in jobs):
            lp = torch.log_softmax(logits.float(), -1)
            for j, row in zip(jobs, lp):
                j.last = row

    def _emitted(self, job: Job, toks: list[int]) -> bool:
        """After each token of a row: log-prob recorded, text cut at a stop string, final text streamed.
        True when the row is done: a stop string, its own max_tokens or EOS (where generate stops it too)."""
        if job.logprobs is not None:
            job.entries.append(_entry(job.last, toks[-1], job.logprobs))
        text = self.tok.decode([t for t in toks if t not in self.eos], skip_special_tokens=True)
        cut = stop_index(text, job.stops) if job.stops else None
        if cut is not None:
            text, job.stopped = text[:cut], True
        job.text = text
        if job.stream:
            final = len(text) if job.stopped else len(text) - held_back(text, job.stops)
            if text.endswith("\ufffd") and not job.stopped:  # an incomplete UTF-8 sequence
                final = min(final, len(text) - 1)
            if final > job.sent:
                job.out.put((job.index, "text", text[job.sent:final]))
                job.sent = final
        if done := job.stopped or len(toks) >= job.max_tokens or toks[-1] in self.eos:
            self._done(job, toks)
        return done

    def logprobs(self, job: Job, prompt_text: str | None, as_ids: bool) -> dict:
        """OpenAI's completions ``logprobs`` of a done job (with echo, prompt_text: the prompt's tokens first).
        text_offset: where each token starts in the choice's text, the length of what the tokens before it decode to
        (one token alone may be part of a character)."""
        def name(t: int) -> str:
            return f"token_id:{t}" if as_ids else self.tok.decode([t], skip_special_tokens=False)

        def starts(ids: list[int], base: int = 0) -> list[int]:
            return [base + len(self.tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]

        offsets = starts(job.tokens) if prompt_text is None else starts(job.ids) + starts(job.tokens, len(prompt_text))
        return {"tokens": [name(t) for t, _, _ in job.entries],
                "token_logprobs": [lp for _, lp, _ in job.entries],
                "top_logprobs": [None if top is None else {**{name(i): v for i, v in top}, name(t): lp}
                                 for t, lp, top in job.entries],
                "text_offset": offsets}


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="evident engine", docs_url=None, redoc_url=None)

    @app.exception_handler(BadRequest)
    async def _bad(_req: Request, e: BadRequest):
        return _error(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"invalid request: {first.get('msg', 'bad body')}" + (f" ({param})" if param else ""), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail))

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": 0, "owned_by": "evident"}]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        if req.temperature != 0:
            raise BadRequest(f"temperature must be 0: this endpoint decodes greedily (got {req.temperature})", "temperature")
        if req.top_p != 1:
            raise BadRequest("top_p must be 1: this endpoint decodes greedily", "top_p")
        if req.n != 1:
            raise BadRequest("n must be 1", "n")
        if req.model is not None and req.model != engine.model_id:
            raise BadRequest(f"model {req.model!r} is not served here; /v1/models lists {engine.model_id!r}", "model", 404)
        if req.stream and req.echo:
            raise BadRequest("echo is not served with stream", "echo")
        if req.stream and req.logprobs is not None:
            raise BadRequest("logprobs are not served with stream", "logprobs")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise BadRequest("stop: at most 4 non-empty strings", "stop")
        prompts = engine.prompts(req.prompt, req.max_tokens)  # checked before a stream's 200 is sent
        out: queue.Queue = queue.Queue()
        jobs = [Job(i, ids, req.max_tokens, stops, req.logprobs, req.echo, req.stream, out)
                for i, (ids, _) in enumerate(prompts)]
        engine.submit(jobs)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def body(choices: list[dict], usage: bool = False) -> dict:
            doc = {"id": cid, "object": "text_completion", "created": created, "model": engine.model_id,
                   "choices": choices}
            if usage:
                p, c = sum(len(j.ids) for j in jobs), sum(len(j.tokens) for j in jobs)
                doc["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
            return doc

        def choice(i: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

        def results():  # the worker's events until every prompt is done
            pending = len(jobs)
            while pending:
                i, kind, value = out.get()
                pending -= kind == "done"
                yield i, kind, value

        if not req.stream:
            for _i, kind, value in results():
                if kind == "error":
                    return _error(500, value)
            return body([choice(j.index, (text if req.echo else "") + j.text, j.finish, None if req.logprobs is None
                                else engine.logprobs(j, text if req.echo else None, req.return_tokens_as_token_ids))
                         for j, (_, text) in zip(jobs, prompts)], usage=True)

        def events():
            for i, kind, value in results():
                if kind == "error":
                    yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                    return
                finish = jobs[i].finish if kind == "done" else None
                yield f"data: {json.dumps(body([choice(i, value or '', finish)]))}\n\n"
            if (req.stream_options or {}).get("include_usage"):
                yield f"data: {json.dumps(body([], usage=True))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def load_engine(ckpt_dir: str, device: str = "cpu", dtype: str = "float32", backend: str = "single",
                model_id: str | None = None, max_batch: int = MAX_BATCH, window_s: float = WINDOW_S) -> Engine:
    from .checkpoint import eos_ids, load_model

    if backend != "single":
        raise SystemExit("engine.serve: only the single-device backend is served")
    model = load_model(ckpt_dir, device=device, dtype=getattr(torch, dtype))
    tok = Tokenizer.from_file(os.path.join(ckpt_dir, "tokenizer.json"))
    return Engine(model, tok, eos_ids(ckpt_dir), model_id or os.path.basename(os.path.normpath(ckpt_dir)),
                  max_batch, window_s)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--backend", default="single", choices=["single"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-id", default="evident-engine", help="the id /v1/models lists and requests may name")
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH, choices=range(1, MAX_BATCH + 1),
                    metavar=f"1..{MAX_BATCH}", help="rows decoded together (1: one at a time)")
    ap.add_argument("--batch-window-ms", type=float, default=WINDOW_S * 1e3,
                    help="how long an idle worker waits for more rows after the first")
    a = ap.parse_args(argv)
    engine = load_engine(a.checkpoint, a.device, a.dtype, a.backend, a.model_id, a.max_batch, a.batch_window_ms / 1e3)
    print(f"[serve] engine loaded ({a.device}, {a.dtype}, batches of up to {a.max_batch}); "
          f"listening on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(create_app(engine), host=a.host, port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
