"""Engine targets (`engines:`): engines a campaign holds to the oracle beside its own, and how to talk to them.

A target is `{name, kind, ...}`. The builtin engine (this repository's, `parity.backends` x `parity.kernels`) is
always there and has no entry; the others are:

- `openai`: an OpenAI-compatible server, at `url` (its base, ending in /v1) or started here from
  `serve: {command, port, ready}` on 127.0.0.1 (`served`: polled on `ready` until it answers, always stopped);
- `command`: a command template run once per request; it reads a JSON request and writes a JSON trace, both
  checked against the schemas below (`REQUEST`, `TRACE`).

An entry may name a `recipe` instead (workflow/plan/recipes.py): the campaign check expands it into such an entry.
Templates are split into words first (shlex), then each word's placeholders are filled: `{python}` (this
interpreter), `{checkpoint}`, `{dtype}` (the target's), `{device}`, `{name}`, `{threads}`, `{gguf}` (the checkpoint
converted to GGUF, `weights: gguf`), `{adapters}` (workflow/adapters/), and `{port}` (serve) or `{request}` `{out}`
(command); a filled path with spaces stays one word. Only `{identifier}` is a placeholder: other braces (a JSON
argument) are the command's own. This module owns checking a target before any work
(`problems`), which targets the HTTP benchmark runs (`bench_targets`: `engine`, the builtin engine through
`python -m evident.engine.serve`, and `openai` entries), the server lifecycle (`served`, `engine_server`, `endpoint`), the
completions client (`Client`, streaming too), what a server offers (`offers`) and the command runner
(`run_command`). It imports neither torch nor the engine: the campaign check uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jsonschema import Draft202012Validator

from evident.workflow.core.privacy import redact_path, scrub
from evident.workflow.models import gguf
from evident.workflow.plan import recipes
from evident.workflow.plan.runs import BACKENDS, BENCH_BACKENDS, KERNELS, run_name

REPO = Path(__file__).resolve().parents[2]
ENGINE = "engine"  # the builtin engine through its own server, as the quality and HTTP bench stages name it
BUILTIN = "builtin"  # its kind (an `engines:` entry may not take it)
# names a target may not take: the builtin engine's runs, transformers' bench cells, the quality stage's own targets
# and its gate file (quality/gsm8k-<target>.json)
RESERVED = frozenset({run_name(b, k) for b in BACKENDS for k in KERNELS} | set(BENCH_BACKENDS) | {ENGINE, "gate"})
COMMON = {"python", "checkpoint", "dtype", "device", "name", "threads", "gguf", "adapters"}  # any template may use
NEEDS = {"serve": {"port"}, "command": {"request", "out"}}  # and those each kind's template must use
READY_PATH = "/v1/models"
API_PATH = "/v1"  # a served target's base URL: http://127.0.0.1:<port>/v1
READY_TIMEOUT_S = 300  # a serve entry's `ready_timeout_s` by default
REQUEST_TIMEOUT_S = 600
REACH_TIMEOUT_S = 5  # the campaign check's GET of <url>/models
MAX_LOGPROBS = 20  # what parity asks a server for, at most (vLLM's and engine.serve's limit)


class TargetError(RuntimeError):
    """A target that cannot be run as asked: the message names the target and what to do."""


# --- the campaign check ------------------------------------------------------------------------------------------

def names(config: dict) -> list[str]:
    """The targets parity runs, in the campaign's order (not those with `parity: false`)."""
    return [e["name"] for e in config.get("engines", []) if e.get("parity", True)]


def pairs(config: dict) -> list[tuple[str, str]]:
    """The variant pairs: (entry, the entry it must agree with), in the campaign's order."""
    return [(e["name"], e["agrees_with"]) for e in config.get("engines", []) if e.get("agrees_with")]


def by_name(config: dict) -> dict[str, dict]:
    return {e["name"]: e for e in config.get("engines", [])}


PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _fields(word: str) -> set[str]:
    return set(PLACEHOLDER.findall(word))


def template_problems(where: str, template: str, kind: str) -> list[tuple[str, str]]:
    """A template's words: parseable, its placeholders known and the kind's present, its executable there."""
    try:
        words = shlex.split(template)
        fields = set().union(*(_fields(w) for w in words)) if words else set()
    except ValueError as e:
        return [(where, f"cannot be split into words ({e}); quote it as a shell would")]
    if not words:
        return [(where, "is empty")]
    out = []
    if unknown := sorted(fields - COMMON - NEEDS[kind]):
        out.append((where, f"unknown placeholder(s) {', '.join('{' + f + '}' for f in unknown)}; it may use "
                           f"{', '.join('{' + f + '}' for f in sorted(COMMON | NEEDS[kind]))}"))
    if missing := sorted(NEEDS[kind] - fields):
        out.append((where, f"needs {' and '.join('{' + f + '}' for f in missing)}: "
                           + ("where the server listens" if kind == "serve" else "the request it reads and the trace it writes")))
    exe = words[0]
    if not _fields(exe) and not (shutil.which(exe) if "/" not in exe else os.access(exe, os.X_OK) and Path(exe).is_file()):
        out.append((where, f"the executable {exe!r} is not "
                           + ("an executable file" if "/" in exe else "on PATH") + " (use {python} for this interpreter)"))
    return out


def problems(config: dict) -> list[tuple[str, str]]:
    """What the schema cannot say about `engines:`, as (key, message), before any work: names unique and not the
    builtin engine's, each kind's keys, the templates (their placeholders and executable)."""
    out, seen = [], set()
    entries = by_name(config)
    for i, e in enumerate(config.get("engines", [])):
        at, kind = f"engines.{i}", e.get("kind")
        if kind is None:
            out.append((at, "needs a `recipe` (one of the engines users run: docs/engine-targets.md) or a `kind` "
                            "(openai or command)"))
            continue
        if (other := e.get("agrees_with")) is not None:
            twin = entries.get(other)
            if twin is None or other == e["name"]:
                out.append((f"{at}.agrees_with", f"{other!r} is not another entry of `engines:` (entries: "
                                                 f"{', '.join(entries)})"))
            elif not (e.get("parity", True) and twin.get("parity", True)):
                out.append((f"{at}.agrees_with", "a variant pair is compared in parity: neither entry may set parity: false"))
        for node, key in ((e.get("serve") or {}, "command"), (e, "command")):
            if "{gguf}" in (node.get(key) or "") and e.get("weights") != "gguf":
                out.append((at, "{gguf} is the checkpoint converted to GGUF: set `weights: gguf` (or use a recipe that "
                                "reads GGUF)"))
        if e["name"] in RESERVED:
            out.append((f"{at}.name", f"{e['name']!r} is a name of the builtin engine's runs or of the quality stage's "
                                      "targets; choose another"))
        if e["name"] in seen:
            out.append((f"{at}.name", f"{e['name']!r} is given twice"))
        seen.add(e["name"])
        if kind == BUILTIN:
            out.append((f"{at}.kind", "builtin: the engine of this repository always runs, as parity.backends x "
                                      "parity.kernels; `engines:` lists the others (kind openai or command)"))
            continue
        allowed = {"openai": ("url", "serve"), "command": ("command",)}[kind]
        if extra := [k for k in ("url", "serve", "command") if k in e and k not in allowed]:
            out.append((at, f"kind {kind} takes no {', '.join(extra)}"))
        if kind == "openai" and ("url" in e) == ("serve" in e):
            out.append((at, "kind openai needs either `url` (a running server) or `serve` (a command that starts one), "
                            "not " + ("both" if "url" in e else "neither")))
        if kind == "command" and "command" not in e:
            out.append((at, "kind command needs `command`, a template with {request} and {out}"))
        if "ready_timeout_s" in e and "serve" not in e:
            out.append((f"{at}.ready_timeout_s", "applies to a server the stage starts (`serve`)"))
        if "serve" in e:
            out += template_problems(f"{at}.serve.command", e["serve"]["command"], "serve")
        if kind == "command" and "command" in e:
            out += template_problems(f"{at}.command", e["command"], "command")
    return out


def bench_targets(config: dict) -> list[str]:
    """The targets the HTTP benchmark (stage serve_bench) runs: `bench.http.targets`, or by default the builtin
    engine and every `openai` entry of `engines:`."""
    chosen = config["bench"]["http"]["targets"]
    return list(chosen) if chosen is not None else [ENGINE, *(e["name"] for e in config.get("engines", [])
                                                              if e.get("kind") == "openai")]


def soak_targets(config: dict) -> list[str]:
    """The targets the soak stage runs: `soak.targets`, or by default the HTTP bench's (bench_targets)."""
    return list(config["soak"]["targets"] or bench_targets(config))


def bench_problems(config: dict) -> list[tuple[str, str]]:
    """`bench.http` before any work: each target `engine` or an `openai` entry of `engines:`, each named once, and
    a prompt for every request in flight where the distinct-prompts contract runs (`bench.prompts`)."""
    http, out = config["bench"]["http"], []
    engines = by_name(config)
    for i, t in enumerate(http["targets"] or []):
        if t != ENGINE and engines.get(t, {}).get("kind") != "openai":
            known = [ENGINE, *(n for n, e in engines.items() if e.get("kind") == "openai")]
            out.append((f"bench.http.targets.{i}", f"{t!r} is neither {ENGINE} (the builtin engine through its server) "
                                                   "nor an `engines:` entry of kind openai"
                        + (" (a command target takes no HTTP requests)" if t in engines else
                           f"; the targets here: {', '.join(known)}")))
    if http["targets"] is not None and len(set(http["targets"])) < len(http["targets"]):
        out.append(("bench.http.targets", f"a target appears twice: {http['targets']}"))
    prompts = config["bench"].get("prompts") or []
    if prompts and len(prompts) < max(http["concurrency"]):
        out.append(("bench.http.concurrency", f"{len(prompts)} bench.prompts for concurrency up to "
                                              f"{max(http['concurrency'])}: request r in flight sends prompts[r] (never "
                                              "cycled); give as many prompts as the largest concurrency, or lower it"))
    return out


def reach_problems(config: dict) -> list[tuple[str, str]]:
    """Each `url` the campaign's stages use must answer GET <url>/models now (EVIDENT_SKIP_ENDPOINT_CHECK=1 skips
    this, for a submit host that cannot reach a server its jobs can)."""
    if os.environ.get("EVIDENT_SKIP_ENDPOINT_CHECK"):
        return []
    stages = set(config["stages"])
    used = set(names(config)) if "parity" in stages else set()
    if "quality" in stages:
        used |= {t for t in config["quality"]["targets"] if isinstance(t, str)}
    if "serve_bench" in stages:
        used |= set(bench_targets(config))
    if "soak" in stages:
        used |= set(soak_targets(config))
    return [(f"engines.{i}.url", f"{e['name']}: GET <url>/models failed ({why}); start the server, or set "
                                 "EVIDENT_SKIP_ENDPOINT_CHECK=1 where only the jobs can reach it")
            for i, e in enumerate(config.get("engines", []))
            if "url" in e and e["name"] in used and (why := unreachable(e["url"]))]


def unreachable(url: str) -> str | None:
    try:
        Client(url).get("/models", REACH_TIMEOUT_S)
    except (OSError, ValueError, TargetError) as e:  # URLError is an OSError; a reply that is not JSON a ValueError
        return f"{type(e).__name__}: {getattr(e, 'reason', e)}"
    return None


# --- templates and processes -------------------------------------------------------------------------------------

def fill(template: str, **values) -> list[str]:
    """The template's words with their placeholders filled (`python` is this interpreter); any other braces are left
    as written (a JSON argument needs no doubled braces)."""
    values = {"python": sys.executable, **{k: str(v) for k, v in values.items()}}
    return [PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), w) for w in shlex.split(template)]


def threads() -> int:
    """The cores this process may run on: what a recipe gives its engine ({threads})."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def prepared(spec: dict, ckpt: Path, dtype: str, logs: Path) -> tuple[dict, dict | None]:
    """The values a target's template takes beyond the common ones, and the converted weights' record (None: the
    checkpoint as it is): `{gguf}` converts the checkpoint with llama.cpp's own converter, in the engine's
    environment, cached by the files' hashes (workflow/models/gguf.py)."""
    values = {"name": spec["name"], "threads": threads(), "adapters": recipes.ADAPTERS}
    if spec.get("weights") != "gguf" or "url" in spec:
        return values, None
    python = recipes.python_of(spec) if "recipe" in spec else sys.executable
    # llama.cpp's converter, as `make engines` unpacks it beside the engine's environment
    converter = Path(python).parents[1] / "convert"
    try:
        converted = gguf.convert(Path(ckpt), python, converter, gguf.GGML[dtype], gguf.CACHE,
                                 logs / f"{spec['name']}-gguf.log")
    except gguf.ConvertError as e:
        raise TargetError(f"target {spec['name']}: {e}") from None
    return {**values, "gguf": converted["path"]}, {k: str(v) if isinstance(v, Path) else v for k, v in converted.items()
                                                  if k != "path"}


def environ(spec: dict) -> dict | None:
    """The process environment of a target's server or command: this one's with the entry's `env` over it."""
    return {**os.environ, **spec["env"]} if spec.get("env") else None


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: servers started together each get their own
_HANDING = threading.Lock()
_PICK = random.SystemRandom()  # not the seeded global generator
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> range:
    """The ports the OS takes for bind(("", 0)) and for client connections' own end (Linux's ip_local_port_range);
    empty where it cannot be read."""
    try:
        lo, hi = map(int, EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return range(0)
    return range(lo, hi + 1)


def free_port() -> int:
    """A port of 127.0.0.1 that nothing is bound to and that this process has not handed out before, below the range
    the OS takes client connections' ports from where that range is known. A port from bind(0) lies in that range,
    where any client connection may take it before the server binds it (seen: "port in use" as ten servers started
    together); the OS may also return a port again once its probe socket closes, before the first server it was given
    binds it."""
    below = ephemeral_ports().start
    own = below > 2048  # room below the range to pick from; else the OS's port, free already
    with _HANDING:
        while True:
            port = _PICK.randrange(max(1024, below - 20000), below) if own else _os_port()
            if port not in _HANDED_OUT and (not own or port_free(port)):
                _HANDED_OUT.add(port)
                return port


def _os_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (connections closed a moment ago, in TIME_WAIT, do not count: servers bind
    with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _where(log: Path) -> str:
    """How a message names a log: relative to the evidence directory where it is in one (logs/...)."""
    return f"see {log.relative_to(log.parents[1]).as_posix()}"


@contextlib.contextmanager
def served(argv: list[str], port: int, log: Path, what: str, ready: str = READY_PATH, cwd: Path | None = None,
           env: dict | None = None, timeout: float = READY_TIMEOUT_S):
    """Run argv, a server that listens on 127.0.0.1:port, until GET ready answers within timeout seconds: yields
    (base URL `.../v1`, seconds to ready); always stopped (terminate, then kill). Its output goes to log."""
    if not port_free(port):  # another server there would answer the readiness poll and every request
        raise TargetError(f"{what}: port {port} of 127.0.0.1 is in use; free it or leave serve.port out (a free one)")
    base, root = f"http://127.0.0.1:{port}{API_PATH}", f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as logf:
        try:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        except OSError as e:
            raise TargetError(f"{what}: cannot start {argv[0]!r}: {e.strerror}") from e
        try:
            t0 = time.perf_counter()
            while True:
                if proc.poll() is not None:
                    raise TargetError(f"{what} exited with {proc.returncode} before it was ready ({_where(log)})")
                try:
                    with urllib.request.urlopen(f"{root}{ready}", timeout=2):  # any 2xx: an error status raises
                        break
                except OSError:  # refused, reset, an error status (HTTPError), a timeout
                    if time.perf_counter() - t0 > timeout:
                        raise TargetError(f"{what} was not ready within {timeout:.0f}s ({_where(log)}; a slower "
                                          "server: raise the entry's ready_timeout_s)") from None
                    time.sleep(0.2)
            try:
                yield base, time.perf_counter() - t0
            except OSError as e:  # refused or reset: where the server has died under its caller, say that
                try:
                    code = proc.wait(timeout=2)  # a server that refuses may be one still exiting
                except subprocess.TimeoutExpired:
                    raise e from None
                raise TargetError(f"{what} exited with {code} while in use ({_where(log)})") from e
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def engine_server(ckpt: Path, device: str, dtype: str, log: Path, code: Path = REPO, env: dict | None = None,
                  kernels: str = "torch", args: tuple[str, ...] = ()):
    """`python -m evident.engine.serve` of the engine package under `code` (run from there, so that it is the one imported)
    on a free port of 127.0.0.1, with the decode path `kernels` and any further `args` of its own: yields (base URL,
    seconds to ready); always stopped."""
    port = free_port()
    argv = [sys.executable, "-m", "evident.engine.serve", "--checkpoint", str(Path(ckpt).resolve()), "--device", device,
            "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--model-id", "evident-engine",
            "--kernels", kernels, *args]
    with served(argv, port, log, "the engine server", cwd=code, env=env) as out:
        yield out


@contextlib.contextmanager
def endpoint(spec: dict, ckpt: Path, dtype: str, device: str, log: Path, values: dict | None = None):
    """An `openai` target's base URL: its `url`, or its `serve` command started here (log: its output), with its
    `env` and `ready_timeout_s`; values: its `prepared` values where the caller has them already."""
    if "url" in spec:
        yield spec["url"].rstrip("/")
        return
    serve = spec["serve"]
    port = serve.get("port") or free_port()
    if values is None:
        values, _ = prepared(spec, ckpt, dtype, log.parent)
    argv = fill(serve["command"], port=port, checkpoint=Path(ckpt).resolve(), dtype=dtype, device=device, **values)
    with served(argv, port, log, f"target {spec['name']}'s server", serve.get("ready") or READY_PATH,
                env=environ(spec), timeout=spec.get("ready_timeout_s") or READY_TIMEOUT_S) as (base, _):
        yield base


# --- the completions client --------------------------------------------------------------------------------------

class ServerError(TargetError):
    def __init__(self, status: int, message: str):
        super().__init__(f"the server answered {status}: {message}")
        self.status = status


class Client:
    """OpenAI's legacy completions API over urllib: `get`, `complete`, `complete_all` (concurrent requests) and
    `stream` (server-sent events, each with the time it arrived)."""

    def __init__(self, base: str, timeout: float = REQUEST_TIMEOUT_S):
        self.base, self.timeout, self.model = base.rstrip("/"), timeout, None

    @staticmethod
    def _open(req, timeout: float):
        """urlopen, an error status raised as a ServerError with the start of the server's answer."""
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise ServerError(e.code, e.read()[:500].decode(errors="replace")) from e

    def _call(self, req, timeout: float) -> dict:
        with self._open(req, timeout) as r:
            return json.loads(r.read())

    def get(self, path: str, timeout: float = 30) -> dict:
        return self._call(f"{self.base}{path}", timeout)

    def connect(self) -> "Client":
        """Read /models: requests name its first model (a server of several would otherwise pick)."""
        data = self.get("/models").get("data") or []
        self.model = data[0]["id"] if data else None
        return self

    def _request(self, body: dict) -> urllib.request.Request:
        """POST /completions; greedy (temperature 0) unless body says otherwise; the model named where known."""
        body = {"temperature": 0, **({"model": self.model} if self.model else {}), **body}
        return urllib.request.Request(f"{self.base}/completions", data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})

    def complete(self, body: dict) -> dict:
        return self._call(self._request(body), self.timeout)

    def stream(self, body: dict, clock=time.perf_counter):
        """POST /completions with `stream: true`: yields (clock() when the event's line arrived, its JSON) for each
        server-sent `data:` event until `[DONE]` or the end of the stream. An error status is a ServerError; an
        event that is not JSON a TargetError."""
        with self._open(self._request({**body, "stream": True}), self.timeout) as resp:
            for line in resp:
                at = clock()
                data = line.decode("utf-8", errors="replace").strip()
                if not data.startswith("data:"):
                    continue  # the blank line between events, an SSE comment
                data = data.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                try:
                    yield at, json.loads(data)
                except ValueError:
                    raise TargetError(f"a streamed event is not JSON: {data[:200]!r}") from None

    def complete_all(self, bodies: list[dict]) -> list[dict]:
        """The bodies sent at once, one connection each (a server that batches may batch them), in order."""
        with ThreadPoolExecutor(max(1, len(bodies))) as pool:
            return list(pool.map(self.complete, bodies))


def model_id(model) -> str | None:
    """A server's model id as evidence holds it: vLLM names a model by its checkpoint's path unless told a name."""
    if model is None:
        return None
    return redact_path(str(model)) if Path(str(model)).is_absolute() else scrub(str(model))


def token_ids(choice: dict) -> list[int] | None:
    """The choice's tokens as ids where the server named them `token_id:<id>` (return_tokens_as_token_ids), else None."""
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens is None or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return None
    try:
        return [int(t.removeprefix("token_id:")) for t in tokens]
    except ValueError:
        return None


def top_entries(entry: dict | None) -> list[tuple[int, float]]:
    """One position's top_logprobs {`token_id:<id>`: log-prob} as (id, log-prob), best first."""
    pairs = [(int(k.removeprefix("token_id:")), float(v)) for k, v in (entry or {}).items() if k.startswith("token_id:")]
    return sorted(pairs, key=lambda p: -p[1])


def offers(client: Client, prompt_ids: list[int], top_k: int, dialect: str = "openai") -> dict:
    """What the server offers parity, found with one-token requests: a prompt of token ids, the tokens named back as
    ids (`token`: both), log-probs (how many a position), and `echo` with prompt log-probs (teacher forcing; the
    max_tokens it takes with echo: 0, else 1). An error status answers no, a 5xx recorded under `refused` (llama.cpp's
    server answers a prompt of ids with 500) once a text request shows the server works. Dialect `text`: nothing is
    probed."""
    out = {"dialect": dialect, "token_prompt": False, "token_ids": False, "logprobs": 0, "echo": False,
           "echo_max_tokens": None, "refused": []}
    if dialect == "text":
        return out

    def accepted(body: dict) -> dict | None:
        try:
            return client.complete(body)["choices"][0]
        except ServerError as e:
            if e.status >= 500:
                out["refused"].append(f"{e.status}: {str(e).split(': ', 1)[-1][:120]}")
            return None

    if accepted({"prompt": prompt_ids, "max_tokens": 1}) is None:
        if out["refused"]:
            client.complete({"prompt": "Hello", "max_tokens": 1})  # a server that fails text too: its error stands
        return out
    out["token_prompt"] = True
    for k in dict.fromkeys((MAX_LOGPROBS, min(top_k, MAX_LOGPROBS), 5, 2, 1)):
        c = accepted({"prompt": prompt_ids, "max_tokens": 1, "logprobs": k, "return_tokens_as_token_ids": True})
        if c is not None and token_ids(c) is not None:
            out.update(token_ids=True, logprobs=min(k, min(len(top_entries(t)) for t in c["logprobs"]["top_logprobs"])))
            break
    if not out["token_ids"]:
        return out
    for max_tokens in (0, 1):
        c = accepted({"prompt": prompt_ids, "max_tokens": max_tokens, "logprobs": out["logprobs"], "echo": True,
                      "return_tokens_as_token_ids": True})
        tops = ((c or {}).get("logprobs") or {}).get("top_logprobs") or []
        if (token_ids(c or {}) or [])[:len(prompt_ids)] == prompt_ids and len(tops) >= len(prompt_ids) \
                and all(top_entries(t) for t in tops[1:len(prompt_ids)]):  # the first prompt token has none
            out.update(echo=True, echo_max_tokens=max_tokens)
            break
    return out


def level(offered: dict) -> str:
    """`token` where ids go in and come back, else `text` (a text-level comparison only)."""
    return "token" if offered["token_prompt"] and offered["token_ids"] else "text"


# --- the command runner ------------------------------------------------------------------------------------------

_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_PER_POSITION = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
REQUEST = {  # what a command target reads (docs/engine-targets.md)
    "type": "object", "required": ["schema", "batch", "top_k", "cases"],
    "properties": {
        "schema": {"const": "evident-request/1"},
        "batch": {"type": "integer", "minimum": 1},
        "top_k": {"type": "integer", "minimum": 1},
        "eos_token_ids": _IDS,
        "cases": {"type": "array", "items": {
            "type": "object", "required": ["name", "prompt_ids", "max_new_tokens"],
            "properties": {"name": {"type": "string"}, "prompt_ids": _IDS, "max_new_tokens": {"type": "integer"},
                           "forced_ids": _IDS,
                           "score_ids": {"type": "array", "items": _IDS}}}}}}
TRACE = {  # what it writes
    "type": "object", "required": ["cases"],
    "properties": {
        "engine": {"type": "string"},
        "cases": {"type": "array", "items": {
            "type": "object", "required": ["name", "rows"],
            "properties": {
                "name": {"type": "string"},
                "rows": {"type": "array", "items": {"type": "object", "required": ["generated_ids"],
                                                     "properties": {"generated_ids": _IDS}}},
                "forced_rows": {"type": "array", "items": {
                    "type": "object", "required": ["top_ids", "top_logprobs", "score_logprobs"],
                    "properties": {"top_ids": {"type": "array", "items": _IDS}, "top_logprobs": _PER_POSITION,
                                   "score_logprobs": _PER_POSITION}}}}}}}}


class TraceError(TargetError):
    pass


def check_trace(trace, request: dict, where: str) -> dict:
    """The trace against TRACE and the request it answers (its cases in order, `batch` rows each, forced rows with
    a position per scored one and a log-prob per scored id); a TraceError names the first bad field."""
    errors = sorted(Draft202012Validator(TRACE).iter_errors(trace), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        field = ".".join(map(str, e.absolute_path)) or "<top level>"
        raise TraceError(f"{where}: `{field}`: {e.message} (docs/engine-targets.md has the trace schema)")
    asked = [c["name"] for c in request["cases"]]
    if [c["name"] for c in trace["cases"]] != asked:
        raise TraceError(f"{where}: `cases`: names {[c['name'] for c in trace['cases']]}, the request's were {asked}, in order")
    for i, (case, want) in enumerate(zip(trace["cases"], request["cases"])):
        if len(case["rows"]) != request["batch"]:
            raise TraceError(f"{where}: `cases.{i}.rows`: {len(case['rows'])} rows, the request's batch is {request['batch']}")
        for r, row in enumerate(case.get("forced_rows") or []):
            for key in ("top_ids", "top_logprobs", "score_logprobs"):
                if len(row[key]) != len(want["score_ids"]):
                    raise TraceError(f"{where}: `cases.{i}.forced_rows.{r}.{key}`: {len(row[key])} positions, the "
                                     f"request scores {len(want['score_ids'])}")
            for p, (got, ids) in enumerate(zip(row["score_logprobs"], want["score_ids"])):
                if len(got) != len(ids):
                    raise TraceError(f"{where}: `cases.{i}.forced_rows.{r}.score_logprobs.{p}`: {len(got)} log-probs "
                                     f"for the {len(ids)} score_ids of that position")
        if case.get("forced_rows") is not None and len(case["forced_rows"]) != request["batch"]:
            raise TraceError(f"{where}: `cases.{i}.forced_rows`: {len(case['forced_rows'])} rows, the request's batch "
                             f"is {request['batch']}")
    return trace


def run_command(spec: dict, request: dict, workdir: Path, log: Path, **values) -> dict:
    """Write the request to workdir, run the target's command on it (output appended to log) and return its trace,
    checked. A command that fails, or leaves no trace or a bad one, is a TargetError naming the target."""
    Draft202012Validator(REQUEST).validate(request)
    workdir.mkdir(parents=True, exist_ok=True)
    req, out = workdir / f"request-b{request['batch']}.json", workdir / f"trace-b{request['batch']}.json"
    req.write_text(json.dumps(request))
    out.unlink(missing_ok=True)
    argv = fill(spec["command"], request=req.resolve(), out=out.resolve(), **values)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as logf:
        try:
            rc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, env=environ(spec)).returncode
        except OSError as e:
            raise TargetError(f"target {spec['name']}: cannot run {argv[0]!r}: {e.strerror}") from e
    what = f"target {spec['name']}'s trace ({out.name})"
    if rc != 0:
        raise TargetError(f"target {spec['name']}: its command exited with {rc} ({_where(log)})")
    try:
        trace = json.loads(out.read_text())
    except FileNotFoundError:
        raise TraceError(f"{what}: the command wrote no trace to {{out}}") from None
    except ValueError as e:
        raise TraceError(f"{what}: not JSON ({e})") from None
    return check_trace(trace, request, what)
