"""Recipes: the engines users build, each put under the gates by one line (`engines: [{name: vllm, recipe: vllm}]`).

A recipe is data (`RECIPES`): how to start the engine on the campaign's checkpoint, where `make engines` installs it,
the form of the weights it reads, the flags that set its KV cache's dtype, what a DeepSeek config needs of it
(`overrides`), how long it may take to be ready and how parity talks to it (`dialect`: `openai`, vLLM's token ids,
found by probing; `text`, a server that takes and returns text only). Its adapter, where it needs one, is a script
in `workflow/adapters/` run by the engine's own interpreter (llama.cpp's Python API: `llama_cpp.py`; its converter:
`gguf_convert.py`).

`expand` turns an entry into the plain `openai` or `command` entry the stages run (docs/engine-targets.md), before
any work: the recipe's template, then the KV-cache flags, the overrides and the entry's own `args`. Placeholders
filled later, by the stage: `{port}`, `{request}`, `{out}`, `{gguf}` (the converted file, workflow/models/gguf.py) and
`{adapters}` (this folder's adapters). The recorded config holds the expanded entry, so a recipe's change changes the
evidence id. `measured` says where each recipe has run: a recipe not measured is written from the engine's
documentation and says so.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from evident.workflow.models.gguf import GGML

ENGINES = Path(".engines")  # `make engines`' folder, under the working directory the campaign runs in
ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"
VERSION_TIMEOUT_S = 120  # importing vLLM to read its version takes seconds


@dataclass(frozen=True)
class Recipe:
    name: str
    engine: str  # the engine's name in evidence and SUMMARY.md
    kind: str  # the entry it expands to: openai (a server) or command (a trace per request)
    template: str  # its serve command (openai) or its command (command); `{engine_python}` is `python`
    module: str  # the Python package whose __version__ is the engine's version
    env_dir: str | None  # `make engines`' environment (ENGINES / env_dir), the default `python`
    dialect: str = "openai"  # how parity reaches its tokens: openai (probed: vLLM's token ids) or text
    weights: str = "hf"  # the form it reads: hf (the checkpoint's folder) or gguf (converted by llama.cpp's converter)
    kv_cache: dict = field(default_factory=dict)  # dtype -> its flags for a KV cache in that dtype
    environ: dict = field(default_factory=dict)  # set for its process (the entry's `env` wins)
    ready_timeout_s: int = 300
    overrides: tuple = ()  # functions of the model's config: the flags a DeepSeek config needs of this engine
    measured: str = ""  # where it ran under the gates; empty: written from the engine's documentation only

    def flags(self, model: dict) -> list[str]:
        """The overrides' flags for this model (the campaign's resolved checkpoint.config)."""
        return [f for override in self.overrides for f in override(model)]


def integer_groups(model: dict) -> list[str]:
    """transformers leaves n_group and topk_group null for greedy routing; vLLM's DeepSeek-V2 MoE reads integers."""
    return ["--hf-overrides", json.dumps({"n_group": 1, "topk_group": 1})] if model.get("n_group") is None else []


def q_lora_rank(flag: str):
    """llama.cpp's deepseek2 loader reads q_lora_rank unless the model has DeepSeek-V2-Lite's 27 layers: a null one
    is given as 0 through its metadata override flag."""
    return lambda model: [flag, "deepseek2.attention.q_lora_rank=int:0"] if model.get("q_lora_rank") is None else []


_LLAMA_TYPES = {"float32": "0", "float16": "1", "bfloat16": "30"}  # ggml's type ids, as llama_cpp.server takes them

RECIPES = {r.name: r for r in (
    Recipe("vllm", "vLLM", "openai", module="vllm", env_dir="vllm",
           template="{engine_python} -m vllm.entrypoints.openai.api_server --model {checkpoint} --host 127.0.0.1 "
                    "--port {port} --dtype {dtype} --served-model-name {name} --max-model-len {context}",
           kv_cache={"bfloat16": ["--kv-cache-dtype", "bfloat16"], "float16": ["--kv-cache-dtype", "float16"]},
           # its CPU build's default thread binding decodes at ~375 ms a token on 2 cores (nobind: 3-5 ms), and it
           # reserves most of the machine's memory for its KV cache unless told a size (GiB; raise it in `env`)
           environ={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}, ready_timeout_s=900,
           overrides=(integer_groups,),
           measured="CPU (vllm-cpu 0.32.0, float32)"),
    Recipe("sglang", "SGLang", "openai", module="sglang", env_dir="sglang",
           template="{engine_python} -m sglang.launch_server --model-path {checkpoint} --host 127.0.0.1 --port {port} "
                    "--dtype {dtype} --served-model-name {name} --context-length {context}",
           ready_timeout_s=900),
    Recipe("llama-cpp", "llama.cpp (Python API)", "command", module="llama_cpp", env_dir="llama-cpp", weights="gguf",
           template="{engine_python} {adapters}/llama_cpp.py --model {gguf} --request {request} --out {out} "
                    "--threads {threads}",
           kv_cache={d: ["--kv-type", n] for d, n in GGML.items()}, overrides=(q_lora_rank("--kv-override"),),
           measured="CPU (llama-cpp-python 0.3.36, float32)"),
    Recipe("llama-cpp-server", "llama.cpp (server)", "openai", module="llama_cpp", env_dir="llama-cpp",
           weights="gguf", dialect="text",
           # a new request interrupts a streaming one unless --interrupt_requests false
           template="{engine_python} -m llama_cpp.server --model {gguf} --host 127.0.0.1 --port {port} "
                    "--model_alias {name} --n_ctx {context} --n_threads {threads} --interrupt_requests false",
           kv_cache={d: ["--type_k", t, "--type_v", t] for d, t in _LLAMA_TYPES.items()},
           overrides=(q_lora_rank("--kv_overrides"),),
           measured="CPU (llama-cpp-python 0.3.36, float32)"),
    # transformers' own server, from evident's environment (fastapi and uvicorn: transformers[serving])
    Recipe("transformers", "transformers serve", "openai", module="transformers", env_dir=None, dialect="text",
           template="{engine_python} -m transformers.cli.transformers serve --host 127.0.0.1 --port {port} "
                    "--dtype {dtype} --device {device} {checkpoint}",
           measured="CPU (transformers 5.25, float32; make test)"),
)}
MADE = ("vllm", "llama-cpp")  # the environments `make engines` installs


def python_of(entry: dict) -> str:
    """The engine's interpreter: the entry's `python`, else its recipe's environment under .engines/ (none: this one,
    where the engine is evident's own dependency)."""
    recipe = RECIPES[entry["recipe"]]
    if entry.get("python"):
        return entry["python"]
    return str(ENGINES / recipe.env_dir / "bin" / "python") if recipe.env_dir else sys.executable


def expand(config: dict, model: dict) -> None:
    """Each `engines:` entry with a `recipe` made the plain entry the stages run, in place (an expanded one, which
    has its template already, is left)."""
    for e in config.get("engines", []):
        if "recipe" not in e or "serve" in e or "command" in e:
            continue
        r = RECIPES[e["recipe"]]
        dtype = e.get("dtype") or config["dtype"]
        kv = e.setdefault("kv_cache_dtype", dtype)
        own = r.env_dir is None and not e.get("python")  # evident's interpreter, filled where the stage runs
        values = {"engine_python": "{python}" if own else shlex.quote(python_of(e)), "name": e["name"], "dtype": dtype,
                  "context": str(model["max_position_embeddings"])}
        template = r.template
        for k, v in values.items():
            template = template.replace("{" + k + "}", v)
        extra = [*r.kv_cache.get(kv, []), *r.flags(model), *e.get("args", [])]
        template = " ".join([template, *map(shlex.quote, extra)])
        e.setdefault("kind", r.kind)
        if env := {**r.environ, **e.get("env", {})}:
            e["env"] = env
        if r.kind == "openai":
            e.setdefault("dialect", r.dialect)
        if r.weights != "hf":
            e["weights"] = r.weights
        if "url" in e:  # a running server of this engine: its dialect, nothing to start
            continue
        if r.kind == "openai":
            e.setdefault("ready_timeout_s", r.ready_timeout_s)
            e["serve"] = {"command": template}
        else:
            e["command"] = template


def problems(config: dict) -> list[tuple[str, str]]:
    """What a recipe entry needs before any work: its engine's interpreter, and no template of its own."""
    out = []
    for i, e in enumerate(config.get("engines", [])):
        if "recipe" not in e:
            continue
        r = RECIPES[e["recipe"]]
        if "serve" in e or "command" in e:
            out.append((f"engines.{i}", f"recipe {r.name} writes its own {'serve command' if r.kind == 'openai' else 'command'}"
                                        "; put further flags in `args`"))
        if "url" in e and r.kind == "command":
            out.append((f"engines.{i}.url", f"recipe {r.name} runs {r.engine} as a command, not a server: it takes no url"))
        dtype = e.get("dtype") or config["dtype"]
        if e.get("kv_cache_dtype", dtype) not in (dtype, *r.kv_cache):  # a declared cache must be the one that ran
            out.append((f"engines.{i}.kv_cache_dtype", f"recipe {r.name} has no flag for a {e['kv_cache_dtype']} KV "
                                                       f"cache beside {dtype} weights (it has: "
                                                       f"{', '.join(r.kv_cache) or 'none'})"))
        if e.get("kind", r.kind) != r.kind:
            out.append((f"engines.{i}.kind", f"recipe {r.name} is of kind {r.kind}; leave kind out"))
        python = Path(python_of(e))
        if "url" not in e and not python.is_file():
            how = (f"run `make engines` (it installs {r.engine} into {ENGINES / r.env_dir})" if r.env_dir in MADE
                   else f"install {r.engine} into an environment of its own")
            out.append((f"engines.{i}.python", f"{python} does not exist: {how}, or set `python:` to the interpreter "
                                               f"of an environment that has {r.module}"))
    return out


def version(entry: dict) -> str | None:
    """The engine's version as its interpreter reports it (None where it cannot tell: a URL, no interpreter)."""
    if "recipe" not in entry or "url" in entry:
        return None
    module = RECIPES[entry["recipe"]].module
    try:
        out = subprocess.run([python_of(entry), "-c", f"import {module}; print({module}.__version__)"],
                             capture_output=True, text=True, timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def describe(entry: dict, dtype: str) -> dict:
    """What ran, for the evidence: the engine's name and version, the recipe, its flags, the dtypes (dtype: what the
    target computes in; its KV cache's the same unless the entry says otherwise)."""
    r = RECIPES.get(entry.get("recipe", ""))
    return {"engine": r.engine if r else None, "recipe": r.name if r else None, "version": version(entry),
            "args": list(entry.get("args", [])), "weights_dtype": dtype,
            "kv_cache_dtype": entry.get("kv_cache_dtype", dtype), "measured": r.measured if r else None}
