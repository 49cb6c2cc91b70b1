"""An OpenAI-compatible HTTP endpoint over the engine: ``/v1/completions`` and ``/v1/models``.

    python -m engine.serve --checkpoint DIR [--backend single] [--device cpu] [--dtype float32] --port P

Greedy only (``temperature`` 0; anything else is a 400), batch of one, the engine's own ``generate``.
Stop strings are applied to the decoded text: the completion ends before the first stop string, and
generation stops as soon as one appears. ``stream: true`` sends server-sent events (``data: {...}``, then
``data: [DONE]``), holding back any text that could still turn into a stop string. Bad requests get a 4xx
with an OpenAI-style JSON error. Binds 127.0.0.1 unless ``--host`` says otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
import uuid
from typing import Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from .generate import generate


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=0)
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    echo: Literal[False] = False
    logprobs: None = None
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


class Engine:
    """The loaded engine, one request at a time."""

    def __init__(self, model, tokenizer: Tokenizer, eos: list[int], model_id: str):
        self.model, self.tok, self.eos, self.model_id = model, tokenizer, eos, model_id
        self.lock = threading.Lock()

    def run(self, prompt: str, max_tokens: int, stops: list[str], on_text=None) -> tuple[str, str, int, int]:
        """Greedy completion: (text, finish_reason, prompt tokens, completion tokens).
        on_text(delta) is called with text that is final (no stop string can start in it any more)."""
        ids = self.tok.encode(prompt).ids  # special tokens as the tokenizer adds them (BOS), as the oracle
        if not ids:
            raise BadRequest("prompt encodes to no tokens", "prompt")
        limit = self.model.args.max_position_embeddings
        if len(ids) + max_tokens > limit:
            raise BadRequest(f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the model's context of "
                             f"{limit} tokens", "max_tokens")
        state = {"text": "", "sent": 0, "stopped": False}

        def stop(_row: int, toks: list[int]) -> bool:
            text = self.tok.decode([t for t in toks if t not in self.eos], skip_special_tokens=True)
            cut = stop_index(text, stops) if stops else None
            if cut is not None:
                text, state["stopped"] = text[:cut], True
            state["text"] = text
            if on_text is not None:
                final = len(text) if state["stopped"] else len(text) - held_back(text, stops)
                if text.endswith("\ufffd") and not state["stopped"]:  # an incomplete UTF-8 sequence
                    final = min(final, len(text) - 1)
                if final > state["sent"]:
                    on_text(text[state["sent"]:final])
                    state["sent"] = final
            return state["stopped"]

        with self.lock:
            gen = generate(self.model, [ids], max_tokens, self.eos, stop=stop)
        toks = gen.tokens[0]
        text = state["text"]
        if on_text is not None and len(text) > state["sent"]:
            on_text(text[state["sent"]:])
        finish = "stop" if state["stopped"] or (toks and toks[-1] in self.eos) else "length"
        return text, finish, len(ids), len(toks)


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
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise BadRequest("exactly one prompt per request (batch of 1)", "prompt")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise BadRequest("stop: at most 4 non-empty strings", "stop")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def body(text: str, finish: str | None, usage: dict | None = None) -> dict:
            out = {"id": cid, "object": "text_completion", "created": created, "model": engine.model_id,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            if usage is not None:
                out["usage"] = usage
            return out

        def usage(p: int, c: int) -> dict:
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        if not req.stream:
            text, finish, p, c = engine.run(prompts[0], req.max_tokens, stops)
            return body(text, finish, usage(p, c))

        # Validate before the 200 of the stream is sent: a bad prompt is still a 4xx.
        ids = engine.tok.encode(prompts[0]).ids
        limit = engine.model.args.max_position_embeddings
        if not ids or len(ids) + req.max_tokens > limit:
            raise BadRequest(f"{len(ids)} prompt tokens + max_tokens {req.max_tokens} exceed the model's context of "
                             f"{limit} tokens" if ids else "prompt encodes to no tokens", "prompt")
        q: queue.Queue = queue.Queue()

        def work():
            try:
                text, finish, p, c = engine.run(prompts[0], req.max_tokens, stops, on_text=lambda d: q.put(("text", d)))
                q.put(("done", (finish, usage(p, c))))
            except Exception as e:  # noqa: BLE001 - reported in the stream
                q.put(("error", f"{type(e).__name__}: {e}"))

        threading.Thread(target=work, daemon=True).start()

        def events():
            while True:
                kind, value = q.get()
                if kind == "text":
                    yield f"data: {json.dumps(body(value, None))}\n\n"
                elif kind == "done":
                    finish, use = value
                    yield f"data: {json.dumps(body('', finish))}\n\n"
                    if (req.stream_options or {}).get("include_usage"):
                        yield f"data: {json.dumps({**body('', None), 'choices': [], 'usage': use})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                    return

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def load_engine(ckpt_dir: str, device: str = "cpu", dtype: str = "float32", backend: str = "single",
                model_id: str | None = None) -> Engine:
    from .checkpoint import eos_ids, load_model

    if backend != "single":
        raise SystemExit("engine.serve: only the single-device backend is served (batch of 1)")
    model = load_model(ckpt_dir, device=device, dtype=getattr(torch, dtype))
    tok = Tokenizer.from_file(os.path.join(ckpt_dir, "tokenizer.json"))
    return Engine(model, tok, eos_ids(ckpt_dir), model_id or os.path.basename(os.path.normpath(ckpt_dir)))


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
    a = ap.parse_args(argv)
    engine = load_engine(a.checkpoint, a.device, a.dtype, a.backend, a.model_id)
    print(f"[serve] engine loaded ({a.device}, {a.dtype}); listening on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(create_app(engine), host=a.host, port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
