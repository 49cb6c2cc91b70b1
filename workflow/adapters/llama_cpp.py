"""llama.cpp as a `command` engine target (docs/engine-targets.md; the schemas are workflow/plan/targets.py's REQUEST and
TRACE): reads a request, writes a trace, through llama-cpp-python on a GGUF (workflow/models/gguf.py makes one with
llama.cpp's own converter). Standalone: it runs under .engines/llama-cpp/bin/python and imports llama_cpp only.

    python llama_cpp.py --model M.gguf --request REQ.json --out TRACE.json [--kv-type f32|f16|bf16] [--threads N]
                        [--kv-override KEY=TYPE:VALUE ...]

Ids in, ids out: the prompt ids are evaluated as given (llama.cpp adds no BOS to ids). Free rows: greedy
(llama.cpp's greedy sampler) from the prompt ids, `max_new_tokens` or through an EOS id (kept); the binding has no
batch, so each of the `batch` rows is its own run on a reset context. Forced rows: prompt + forced ids evaluated at
once with every position's logits; position p predicts token p + 1 of that path, and the scored positions are the
path's last len(score_ids) ones (the oracle scores every position, the prompt's included). --kv-type is the KV
cache's type (ggml's); --kv-override is llama.cpp's metadata override (`--override-kv`'s format).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time

# this file bears the binding's name: the folder python puts first on sys.path for a script must not shadow it
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]
import llama_cpp  # noqa: E402


def ggml_type(name: str) -> int:
    """ggml's type id of a name, from ggml itself (llama_cpp's constants leave out bf16)."""
    type_name = llama_cpp.llama_cpp._lib.ggml_type_name
    type_name.argtypes, type_name.restype = [ctypes.c_int], ctypes.c_char_p
    ids = [i for i in range(llama_cpp.GGML_TYPE_COUNT) if type_name(i) == name.encode()]
    if not ids:
        raise SystemExit(f"--kv-type {name}: ggml has no such type")
    return ids[0]


def kv_override(text: str) -> tuple[str, bool | int | float | str]:
    """KEY=TYPE:VALUE, TYPE int, float, bool or str (llama.cpp's --override-kv)."""
    key, _, typed = text.partition("=")
    kind, _, value = typed.partition(":")
    cast = {"int": int, "float": float, "str": str, "bool": lambda v: {"true": True, "false": False}[v]}
    if not key or kind not in cast:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=TYPE:VALUE, TYPE one of {', '.join(cast)}")
    try:
        return key, cast[kind](value)
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a {kind}") from None


def greedy(llm: llama_cpp.Llama, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    llm.reset()
    out: list[int] = []
    if max_new <= 0:
        return out
    for tok in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):  # greedy; no penalty
        out.append(tok)
        if tok in eos or len(out) == max_new:
            return out
    return out


def forced(llm: llama_cpp.Llama, path: list[int], score_ids: list[list[int]], top_k: int) -> dict:
    start = len(path) - 1 - len(score_ids)  # the first scored position
    if start < 0:
        raise SystemExit(f"{len(score_ids)} scored positions for a path of {len(path)} tokens")
    llm.reset()
    llm.eval(path[:-1])  # the last token predicts nothing scored
    row = {"top_ids": [], "top_logprobs": [], "score_logprobs": []}
    for p, ids in enumerate(score_ids, start):
        x = llm.scores[p].astype("float64")  # log-softmax in float64, as the oracle's reference
        lse = float(x.max()) + math.log(math.fsum(map(math.exp, (x - x.max()).tolist())))
        top = (-x).argsort(kind="stable")[:top_k].tolist()  # the log-softmax's order is the logits'
        row["top_ids"].append(top)
        row["top_logprobs"].append([float(x[i]) - lse for i in top])
        row["score_logprobs"].append([float(x[i]) - lse for i in ids])
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF")
    ap.add_argument("--request", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-type", default="f32", choices=["f32", "f16", "bf16"], help="the KV cache's type")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-override", type=kv_override, action="append", default=[], metavar="KEY=TYPE:VALUE")
    ap.add_argument("--verbose", action="store_true", help="llama.cpp's own log (loading, context)")
    args = ap.parse_args(argv)
    req = json.loads(open(args.request).read())
    eos = set(req.get("eos_token_ids") or [])
    need = max(len(c["prompt_ids"]) + max(c["max_new_tokens"], len(c.get("forced_ids", []))) for c in req["cases"])
    kv = ggml_type(args.kv_type)
    try:  # n_batch = n_ubatch = n_ctx: a forced path is one pass
        llm = llama_cpp.Llama(model_path=args.model, n_ctx=need, n_batch=need, n_ubatch=need, n_threads=args.threads,
                              n_threads_batch=args.threads, logits_all=True, type_k=kv, type_v=kv,
                              kv_overrides=dict(args.kv_override) or None, verbose=args.verbose)
    except ValueError as e:  # llama.cpp's reason is in its log only
        raise SystemExit(f"{e} (--verbose shows llama.cpp's reason; a DeepSeek-V2 GGUF without q_lora_rank needs "
                         f"--kv-override deepseek2.attention.q_lora_rank=int:0)") from None
    cases = []
    for c in req["cases"]:
        t0 = time.perf_counter()
        rows = [{"generated_ids": greedy(llm, c["prompt_ids"], c["max_new_tokens"], eos)} for _ in range(req["batch"])]
        case = {"name": c["name"], "rows": rows}
        if "forced_ids" in c:
            path = c["prompt_ids"] + c["forced_ids"]
            case["forced_rows"] = [forced(llm, path, c["score_ids"], req["top_k"]) for _ in range(req["batch"])]
        cases.append(case)
        print(f"[llama.cpp] case {c['name']}: {req['batch']} row(s), {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"engine": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}", "cases": cases}, f)


if __name__ == "__main__":
    main()
