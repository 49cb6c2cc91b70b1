"""An OpenAI-compatible HTTP endpoint over the engine: ``/v1/completions`` and ``/v1/models``.

    python -m evident.engine.serve --checkpoint DIR [--backend single] [--device cpu] [--dtype float32] --port P
        [--kernels torch|triton|graph] [--max-batch 8] [--batch-window-ms 2]

Greedy only (``temperature`` 0; anything else is a 400), the engine's own ``generate``. ``prompt`` is a string, a
list of strings, a list of token ids or a list of such lists (one choice per prompt; a string gets the tokenizer's
special tokens, ids are taken as they are). ``logprobs`` k (at most ``MAX_LOGPROBS``) returns, per token, its
log-prob and the top k (plus the token itself, as OpenAI), from the float32 log-softmax of the very logits its
token was picked from; ``echo`` puts the prompt before the completion and, with ``logprobs``, the prompt's
teacher-forced log-probs (``generate.forced``; the first token's is null); a token is named by its text, one
within a multi-byte character by its bytes (OpenAI's ``bytes:\\xNN``), or with ``return_tokens_as_token_ids``
(vLLM's) ``token_id:<id>``. ``max_tokens`` null is OpenAI's default, 16. ``usage`` counts tokens, in a stream too
with ``stream_options.include_usage`` (``stream_options`` without ``stream`` is a 400; its unknown keys are ignored,
as vLLM's). ``ignore_eos`` (vLLM's) decodes past EOS to ``max_tokens``, as the benchmarks do. ``--kernels`` picks
the decode path the campaign's stages time: ``torch`` ops, the Triton kernels (``engine.decode_kernels``) or the
CUDA-graph step (``engine.graph_decode``).

Batching: one worker thread owns the model and runs ``generate``'s loop (``generate.Rows``: the prefill and the
decode step that parity and the bench measure, the graph path's too). A request's prompts are rows; an idle worker
takes what arrives within ``--batch-window-ms`` of the first row, up to ``--max-batch`` rows, prefills them together
(ragged prompts right-padded in one forward, the padding never read), each into its own cache row at its own
position, so a row gets the tokens it gets alone (exactly in float32; in bf16 to rounding, which the bench's rows check
measures). Every unfinished row advances in one batched step; each stops at its own ``max_tokens``, EOS or stop string
and is answered then; a row whose client has gone ends at its next token. Each step is launched before the last one's
tokens reach the host (``Rows.launch``), so the host's work on them (text, stop strings, events) overlaps the next
step on the device; while a row asks for log-probs, the steps run one at a time (their logits come to the host). A
row arriving while a batch decodes (``--join``):
- ``batch`` (the default): waits for the next batch, which starts when the batch's last row ends.
- ``step``: joins it at its next step, prefilled into a free slot between two steps, while the batch has a free slot
  (``--max-batch`` in all) and the cache room for its prompt and ``max_tokens`` (a batch's cache then holds
  ``--cache-len`` positions a row, or what its first rows need if more; under ``batch``, what its rows need); else it
  waits for the next batch, and so do the rows that arrived after it (none passes it over). The rows decoding meanwhile wait for its prefill; rows waiting
  together are prefilled together.
docs/decode-log.md measures the two ("Joining at the next step"): joining pays where a prefill costs a few decode steps
(the CPU's tiny model), not where it costs hundreds (the H200's graph step beside its eager prefill).

Stop strings are applied to the decoded text: the completion ends before the first stop string, and generation
stops as soon as one appears (log-probs still cover every generated token, as vLLM's). ``stream: true`` sends
server-sent events (``data: {...}``, then ``data: [DONE]``): one event per generated token, so that a client can time
each token. An event's text is the text that token made final. It is "" while bytes wait: a token inside a multi-byte
character, or text that could still turn into a stop string; that text comes with a later event. The last event
carries the ``finish_reason`` (as vLLM's). With ``stream_options`` ``{"include_usage": true,
"continuous_usage_stats": true}`` (vLLM's) every event also carries ``usage``: its prompt's tokens and the tokens
generated so far, so that a client counts the tokens each event covers, on this server or one that coalesces.
Bad requests get a 4xx with an OpenAI-style JSON error naming the field; a batch that fails, a 500
for each of its requests; a worker that dies, a 500 for every waiting request and a 503 for every later one.
Handlers are async: a waiting request holds no thread. Binds 127.0.0.1 unless ``--host`` says otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from .checkpoint import enable_decode_path, eos_ids, load_model
from .generate import MAX_BATCH, Rows, fits

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
WINDOW_S = 0.002  # how long an idle worker waits for more rows after the first
WATCH_S = 0.5  # how often a waiting plain request checks that its client is still there
JOINS = ("batch", "step")  # a row arriving while a batch decodes waits for the next batch, or joins it at its next step
JOIN = "batch"  # the default: on the H200 an eager prefill stalls the batch longer than waiting (docs/decode-log.md)
CACHE_LEN = 2048  # join "step": positions a row of a batch's cache holds at least (room to join; one shape to capture)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class StreamOptions(BaseModel):
    """OpenAI's ``include_usage`` and vLLM's ``continuous_usage_stats``; other keys are ignored, as vLLM does."""
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=0)  # null: OpenAI's default, 16 (not the context: a cache that long)
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    echo: bool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


def _error_doc(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error document: a response's body, or a stream's last event."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_doc(status, message, param), status_code=status)


def stop_index(text: str, stops: list[str], start: int = 0) -> int | None:
    """Index of the earliest stop string in text (beginning at start or later), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
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


def _offsets(tok: Tokenizer, ids: list[int]) -> list[int]:
    """Where each of ids starts in their decoded text, in one pass (a token within a character: where it starts)."""
    stream, n, out = DecodeStream(skip_special_tokens=True), 0, []
    for t in ids:
        out.append(n)
        n += len(stream.step(tok, t) or "")
    return out


def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the ByteLevel pre-tokenizer's), character -> byte."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    extra = iter(range(256, 512))
    return {chr(b if b in keep else next(extra)): b for b in range(256)}


BYTE_LEVEL = _byte_level()


@dataclass(eq=False)
class Job:
    """One prompt of a request, a row of a batch. The worker calls ``post((index, kind, value))`` (thread-safe, never
    blocking): ("text", delta) for each token while it decodes (``stream`` only: the text no stop string can start in
    any more, "" while bytes wait), then ("done", rest) with the row's last token (``stream``: the text not yet sent,
    else None), or ("error", message). A stream thus gets exactly one event per token. A
    cancelled row (its client went away) ends at its next token, unanswered. ``ignore_eos``: EOS does not end it."""
    index: int
    ids: list[int]
    max_tokens: int
    stops: list[str]
    logprobs: int | None  # top k per token; None: no log-probs
    echo: bool
    stream: bool
    post: Callable[[tuple], None]
    ignore_eos: bool = False
    text: str = ""
    sent: int = 0
    stopped: bool = False
    tokens: list[int] = field(default_factory=list)
    entries: list = field(default_factory=list)  # _entry per token (echo: the prompt's first, its first one null)
    last: torch.Tensor | None = None  # the log-softmax the row's next token is picked from
    finish: str | None = None  # set when the row is done
    offsets: list[int] = field(default_factory=list)  # where each generated token starts in text
    decoder: DecodeStream = field(default_factory=lambda: DecodeStream(skip_special_tokens=True))
    cancelled: bool = False


class Engine:
    """The loaded engine and its batching worker, the one thread that runs the model."""

    def __init__(self, model, tokenizer: Tokenizer, eos: list[int], model_id: str, max_batch: int = MAX_BATCH,
                 window_s: float = WINDOW_S, join: str = JOIN, cache_len: int = CACHE_LEN):
        if join not in JOINS:
            raise ValueError(f"join must be one of {JOINS}, got {join!r}")
        self.model, self.tok, self.eos, self.model_id = model, tokenizer, eos, model_id
        self.max_batch, self.window_s, self.join = max_batch, window_s, join
        self.cache_len = min(cache_len, model.args.max_position_embeddings)
        self.queue: queue.Queue = queue.Queue()
        self.dead: str | None = None  # why the worker stopped, once it has
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
            if not fits(self.model, [ids], max_tokens):
                raise BadRequest(f"prompt {i}: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                                 f"context of {limit} tokens", "max_tokens")
            out.append((ids, p if isinstance(p, str) else self.tok.decode(ids, skip_special_tokens=True)))
        return out

    def submit(self, jobs: list[Job]) -> None:
        if self.dead is not None:
            raise BadRequest(f"the engine's worker has stopped ({self.dead}); restart the server", None, 503)
        for j in jobs:  # the worker answers any that slip in while it dies (it drains the queue then)
            self.queue.put(j)

    # --- the worker ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        waiting: list[Job] = []
        try:
            with torch.inference_mode():  # as generate's: a graph path's cache is made and reset in it
                while True:
                    waiting = self._batch(waiting)
        except Exception as e:  # noqa: BLE001 - a bug of the worker itself: no batch can run any more; say so, not hang
            self.dead = f"{type(e).__name__}: {e}"
            for j in waiting:
                self._fail(j, f"the engine's worker stopped: {self.dead}")
            while True:
                self._fail(self.queue.get(), f"the engine's worker stopped: {self.dead}")

    def _batch(self, waiting: list[Job]) -> list[Job]:
        """Gather rows, run one batch until every row of it has ended; -> the rows left for the next. ``waiting`` keeps
        every row not yet admitted, and ``live`` every admitted row not yet answered, so that a worker dying here
        answers them all."""
        if not waiting:  # idle: the first row opens a window for the rows that come with it
            waiting.append(self.queue.get())
            deadline = time.monotonic() + self.window_s
            while len(waiting) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    waiting.append(self.queue.get(timeout=left))
                except queue.Empty:
                    break
        self._drain(waiting)  # and what queued while the last batch decoded
        batch = self._admit(waiting, self.max_batch, lambda j: True)
        if not batch:
            return waiting
        live: dict[int, Job] = {}  # slot -> its row
        need = max(len(j.ids) + j.max_tokens for j in batch)
        try:  # join "step": a slot for every row a batch may hold, and room for them (DeepSeek-V4 attends over its
            # whole cache of compressed entries, masked: "batch" keeps the cache the in-process bench times)
            rows = Rows(self.model, *((self.max_batch, max(self.cache_len, need)) if self.join == "step"
                                      else (len(batch), need)))
            self._start(rows, batch, live)
            pending = None  # the step launched last, its tokens not yet handed over
            while live or pending:
                # with log-probs a step's logits come to the host before its pick: one step at a time
                ahead = bool(live) and not any(j.logprobs is not None for j in live.values())
                pending, _ = rows.ahead(pending, self._take(live), ahead)
                if live and not ahead:
                    self._emit(rows, live, *rows.step())
                if self.join == "step" and rows.free():
                    self._drain(waiting)
                    if joining := self._admit(waiting, rows.free(), lambda j: rows.has_room(j.ids, j.max_tokens)):
                        batch += joining
                        self._start(rows, joining, live)
        except Exception as e:  # noqa: BLE001 - reported to every row of the batch still waiting
            for j in batch:
                if j.finish is None:
                    self._fail(j, f"{type(e).__name__}: {e}")
        return waiting

    def _drain(self, waiting: list[Job]) -> None:
        """Every row queued by now, to waiting (without blocking)."""
        while True:
            try:
                waiting.append(self.queue.get_nowait())
            except queue.Empty:
                return

    @staticmethod
    def _admit(waiting: list[Job], room: int, fits: Callable[[Job], bool]) -> list[Job]:
        """Up to room rows of waiting, in arrival order, taken out of it until one does not fit: a row is never passed
        over, so a long one is not kept waiting for ever by short ones joining (a cancelled row is dropped)."""
        waiting[:] = [j for j in waiting if not j.cancelled]
        taken: list[Job] = []
        for j in waiting[:room]:
            if not fits(j):
                break
            taken.append(j)
        del waiting[:len(taken)]
        return taken

    @staticmethod
    def _fail(job: Job, message: str) -> None:
        job.finish = job.finish or "error"
        job.post((job.index, "error", message))

    def _start(self, rows: Rows, jobs: list[Job], live: dict[int, Job]) -> None:
        """Prefill jobs into free slots of rows, together: an echo's prompt log-probs from the prefill's logits
        (position p - 1 predicts token p; the first token has none), then each row's first token."""
        slots, logits = rows.join([j.ids for j in jobs])
        first = []
        for s, j, lg in zip(slots, jobs, logits):
            if j.echo and j.logprobs is not None:
                lp = torch.log_softmax(lg.float(), -1)
                j.entries = [(j.ids[0], None, None)] + [_entry(lp[p - 1], j.ids[p], j.logprobs)
                                                        for p in range(1, len(j.ids))]
            if j.max_tokens:
                live[s] = j
                first.append((s, lg[-1]))
            else:
                rows.leave(s)
                self._done(j, [])
        if first:
            self._emit(rows, live, [s for s, _ in first], torch.stack([lg for _, lg in first]))

    def _emit(self, rows: Rows, live: dict[int, Job], slots: list[int], logits: torch.Tensor) -> None:
        """Each slot's next token, picked from its logits [len(slots), vocab]; a row that ends leaves."""
        jobs = [live[s] for s in slots]
        if any(j.logprobs is not None for j in jobs):
            for j, row in zip(jobs, torch.log_softmax(logits.float(), -1)):
                j.last = row
        rows.advance(slots, logits, self._take(live))

    def _take(self, live: dict[int, Job]) -> Callable[[int, int, float], bool]:
        """Rows' ``take``: a slot's token to its row -> whether the row ends there (it leaves ``live``)."""
        def take(s: int, t: int, _margin: float) -> bool:
            j = live[s]
            j.tokens.append(t)
            if ended := self._emitted(j, j.tokens):
                del live[s]
            return ended

        return take

    def _ends(self, job: Job, toks: list[int]) -> bool:
        """The row's last token is an EOS that ends it (not with ignore_eos)."""
        return bool(toks) and not job.ignore_eos and toks[-1] in self.eos

    def _done(self, job: Job, toks: list[int]) -> None:
        """A row's answer, sent as soon as the row ends, while the rest of its batch decodes on; a stream's last event
        carries the text not yet sent, so that its finish_reason comes with the last token's text."""
        job.tokens = list(toks)
        job.finish = "stop" if job.stopped or self._ends(job, toks) else "length"
        if not job.stopped:  # the whole text, with any incomplete character the stream still holds
            job.text = self.tok.decode([t for t in toks if t not in self.eos], skip_special_tokens=True)
        job.post((job.index, "done", job.text[job.sent:] if job.stream else None))

    def _emitted(self, job: Job, toks: list[int]) -> bool:
        """After each token of a row: log-prob recorded, text extended (one token's worth: no re-decode of the row)
        and cut at a stop string, final text streamed. True when the row is done: cancelled, a stop string, its own
        max_tokens or EOS (where generate stops it too)."""
        if job.cancelled:  # no one waits for this row: end it, unanswered
            return True
        if job.logprobs is not None:
            job.entries.append(_entry(job.last, toks[-1], job.logprobs))
        job.offsets.append(len(job.text))
        if toks[-1] not in self.eos and (delta := job.decoder.step(self.tok, toks[-1])):  # None: within a character
            start = max(0, len(job.text) - max((len(s) for s in job.stops), default=0) + 1)  # a stop may span the seam
            job.text += delta
            if (cut := stop_index(job.text, job.stops, start)) is not None:
                job.text, job.stopped = job.text[:cut], True
        done = job.stopped or len(toks) >= job.max_tokens or self._ends(job, toks)
        if done:  # its last text goes with its finish_reason
            self._done(job, toks)
        elif job.stream:  # an event every token, even of no text: a client times and counts tokens by events
            final = max(job.sent, len(job.text) - held_back(job.text, job.stops))
            job.post((job.index, "text", job.text[job.sent:final]))
            job.sent = final
        return done

    def name(self, t: int, as_ids: bool = False) -> str:
        """A token as the response names it: its text, or (a token within a multi-byte character, whose text alone
        is U+FFFD whichever bytes it holds) OpenAI's ``bytes:\\xNN..``, so that no two tokens share a name."""
        if as_ids:
            return f"token_id:{t}"
        text = self.tok.decode([t], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        piece = self.tok.id_to_token(t) or ""
        if not piece or any(c not in BYTE_LEVEL for c in piece):
            return piece or text  # not a byte-level token: the vocabulary's own name for it
        raw = bytes(BYTE_LEVEL[c] for c in piece)
        try:
            return raw.decode("utf-8")  # a real U+FFFD
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def logprobs(self, job: Job, prompt_text: str | None, as_ids: bool) -> dict:
        """OpenAI's completions ``logprobs`` of a done job (with echo, prompt_text: the prompt's tokens first).
        text_offset: where each token starts in the choice's text (never past its end: a stop string may cut
        within the last token)."""
        offsets = [min(o, len(job.text)) for o in job.offsets]
        if prompt_text is not None:
            offsets = [min(o, len(prompt_text)) for o in _offsets(self.tok, job.ids)] + \
                [len(prompt_text) + o for o in offsets]
        return {"tokens": [self.name(t, as_ids) for t, _, _ in job.entries],
                "token_logprobs": [lp for _, lp, _ in job.entries],
                "top_logprobs": [None if top is None else {**{self.name(i, as_ids): v for i, v in top},
                                                           self.name(t, as_ids): lp}
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

    # async handlers: a request waiting for the worker holds no thread, so any number may wait and /v1/models answers
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": 0, "owned_by": "evident"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
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
        if req.stream_options is not None and not req.stream:
            raise BadRequest("stream_options is only allowed with stream", "stream_options")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise BadRequest("stop: at most 4 non-empty strings", "stop")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        prompts = engine.prompts(req.prompt, max_tokens)  # checked before a stream's 200 is sent
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()

        def post(event: tuple) -> None:  # the worker thread's way into this request's loop
            loop.call_soon_threadsafe(inbox.put_nowait, event)

        jobs = [Job(i, ids, max_tokens, stops, req.logprobs, req.echo, req.stream, post, req.ignore_eos)
                for i, (ids, _) in enumerate(prompts)]
        engine.submit(jobs)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def cancel() -> None:  # the rows still decoding end at their next token: no one is left to answer
            for j in jobs:
                j.cancelled = True

        def body(choices: list[dict], usage: bool = False) -> dict:
            doc = {"id": cid, "object": "text_completion", "created": created, "model": engine.model_id,
                   "choices": choices}
            if usage:
                doc["usage"] = counts(sum(len(j.ids) for j in jobs), sum(len(j.tokens) for j in jobs))
            return doc

        def counts(prompt: int, completion: int) -> dict:
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        def choice(i: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

        async def results():
            """The worker's events until every prompt is done, or the client has gone: asked, as neither a plain
            request nor a stream sending nothing would notice (a stream only at its next send)."""
            pending = len(jobs)
            while pending:
                try:
                    i, kind, value = await asyncio.wait_for(inbox.get(), WATCH_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                pending -= kind == "done"
                yield i, kind, value

        if not req.stream:
            try:
                async for _i, kind, value in results():
                    if kind == "error":
                        return _error(500, value)
            finally:
                cancel()
            if any(j.finish is None for j in jobs):  # the client went away: no one reads this
                return Response(status_code=499)
            return body([choice(j.index, (text if req.echo else "") + j.text, j.finish, None if req.logprobs is None
                                else engine.logprobs(j, text if req.echo else None, req.return_tokens_as_token_ids))
                         for j, (_, text) in zip(jobs, prompts)], usage=True)

        options = req.stream_options or StreamOptions()
        continuous = bool(options.include_usage and options.continuous_usage_stats)  # vLLM's: only with include_usage

        async def events():
            streamed = [0] * len(jobs)  # tokens sent so far, a prompt each
            try:
                async for i, kind, value in results():
                    if kind == "error":
                        yield f"data: {json.dumps(_error_doc(500, value))}\n\n"
                        return
                    # a text event is one token; the done event's row has stopped growing (max_tokens 0: no token)
                    streamed[i] = len(jobs[i].tokens) if kind == "done" else streamed[i] + 1
                    doc = body([choice(i, value or "", jobs[i].finish if kind == "done" else None)])
                    if continuous:  # as vLLM's: the choice's own prompt and its tokens so far
                        doc["usage"] = counts(len(jobs[i].ids), streamed[i])
                    yield f"data: {json.dumps(doc)}\n\n"
            finally:
                cancel()
            if any(j.finish is None for j in jobs):  # the client went away
                return
            if options.include_usage:
                yield f"data: {json.dumps(body([], usage=True))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


KERNELS = ("torch", "triton", "graph")  # the decode paths (workflow.runs.KERNELS: the schema's, the same words)


def load_engine(ckpt_dir: str, device: str = "cpu", dtype: str = "float32", backend: str = "single",
                model_id: str | None = None, max_batch: int = MAX_BATCH, window_s: float = WINDOW_S,
                kernels: str = "torch", join: str = JOIN, cache_len: int = CACHE_LEN) -> Engine:
    if backend != "single":
        raise SystemExit("engine.serve: only the single-device backend is served")
    if kernels != "torch" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(f"engine.serve: --kernels {kernels} on a CPU runs Triton's interpreter: set "
                         "TRITON_INTERPRET=1 in the environment before Python starts")
    model = enable_decode_path(load_model(ckpt_dir, device=device, dtype=getattr(torch, dtype)), kernels)
    tok = Tokenizer.from_file(os.path.join(ckpt_dir, "tokenizer.json"))
    return Engine(model, tok, eos_ids(ckpt_dir), model_id or os.path.basename(os.path.normpath(ckpt_dir)),
                  max_batch, window_s, join, cache_len)


def main(argv: list[str] | None = None) -> None:
    import uvicorn  # only the command line runs the server: the app's importers need not load it

    ap = argparse.ArgumentParser(prog="python -m evident.engine.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--backend", default="single", choices=["single"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-id", default="evident-engine", help="the id /v1/models lists and requests may name")
    ap.add_argument("--kernels", default="torch", choices=KERNELS, help="the decode path (as the campaign's bench.kernels)")
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH, choices=range(1, MAX_BATCH + 1),
                    metavar=f"1..{MAX_BATCH}", help="rows decoded together (1: one at a time)")
    ap.add_argument("--batch-window-ms", type=float, default=WINDOW_S * 1e3,
                    help="how long an idle worker waits for more rows after the first")
    ap.add_argument("--join", default=JOIN, choices=JOINS,
                    help="a row arriving while a batch decodes waits for the next batch, or joins it at its next step")
    ap.add_argument("--cache-len", type=int, default=CACHE_LEN,
                    help="--join step: positions a row of a batch's cache holds at least (at most the context); a row "
                         "joins a running batch only where its prompt and max_tokens fit")
    a = ap.parse_args(argv)
    engine = load_engine(a.checkpoint, a.device, a.dtype, a.backend, a.model_id, a.max_batch, a.batch_window_ms / 1e3,
                         a.kernels, a.join, a.cache_len)
    print(f"[serve] engine loaded ({a.device}, {a.dtype}, {a.kernels} decode path, batches of up to {a.max_batch}, "
          f"late rows join at the next {a.join}); "
          f"listening on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(create_app(engine), host=a.host, port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
