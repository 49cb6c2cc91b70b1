"""What runs, once: a campaign's stages, the engine's backends and decode paths, and the name evidence gives a run.

The enums are the schema's (config/schema.yaml `stages`, `parity.backends`, `bench.backends`, `parity.kernels`), so
the campaign check, the Snakemake rules and wildcards and the stage CLIs accept the same words. The engine owns its transports
(`engine.parallel.BACKENDS`); tests/test_runs.py checks that they are the schema's expert-parallel backends. Read
from YAML, not imported from the engine: validating a campaign must not import torch.

A run is named `<backend><suffix>`: the suffix is empty for the torch decode path, `-triton` or `-graph`
otherwise (`single`, `single-triton`, `collective-graph`); a batch adds `-b<B>` (`parity/single-triton-b8.json`).
A bench cell of the distinct-prompts contract (`bench.prompts`: a different prompt on every row) adds `-distinct`
before the batch (`bench/single-distinct-b8.json`, label `single-graph-distinct-b8`), so that it is never read as
the same-prompt cell beside it. A cell of the benchmark over HTTP is named by its target and concurrency instead,
`http-<target>-c<C>` (`bench/http-engine-c4.json`; the distinct-prompts contract `http-engine-distinct-c4`), so that
no label of it is an in-process cell's. A cell of its rate rung is named by its target and rate, `http-<target>-r<R>`
(`bench/http-engine-r2.json`, `http-engine-r0.5`): requests a second, not in flight, so never read as a concurrency.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from evident.workflow.core.evidence import sha256_bytes

SCHEMA = Path(__file__).resolve().parents[2] / "config/schema.yaml"
_PROPERTIES = yaml.safe_load(SCHEMA.read_text())["properties"]


def _enum(section: str, key: str) -> tuple[str, ...]:
    return tuple(_PROPERTIES[section]["properties"][key]["items"]["enum"])


def schema_default(section: str, key: str):
    """config/schema.yaml's default of `section.key`: code that needs it reads it here, never a copy."""
    return _PROPERTIES[section]["properties"][key]["default"]


STAGES = tuple(_PROPERTIES["stages"]["items"]["enum"])  # those a campaign chooses, in the pipeline's order

BACKENDS = _enum("parity", "backends")  # the engine's: one process, or expert-parallel ranks
EP_BACKENDS = tuple(b for b in BACKENDS if b != "single")  # torchrun ranks, one device each
HF = "hf"  # bench only: transformers' own generate, the reference the engine's timings stand beside
# bench only, each its own cell: transformers' paths, as (from_pretrained keywords, generate keywords). Eager experts
# (named: transformers 5.24 defaults to grouped_mm where it can dispatch it); grouped_mm; grouped_mm with a static
# cache, which transformers compiles on a GPU
HF_PATHS = {HF: ({"experts_implementation": "eager"}, {}), "hf-grouped": ({"experts_implementation": "grouped_mm"}, {}),
            "hf-static": ({"experts_implementation": "grouped_mm"}, {"cache_implementation": "static"})}
BENCH_BACKENDS = _enum("bench", "backends")
ONE_PROCESS = ("single", *HF_PATHS)
KERNELS = _enum("parity", "kernels")  # the engine's decode path: torch ops, the Triton kernels, the CUDA-graph step
# the bench's prompt contracts: one prompt copied to every row (rows route alike), or bench.prompts, one a row
SAME, DISTINCT = "same-prompt", "distinct-prompts"
SHORT = {SAME: "same", DISTINCT: "distinct"}  # in tables, plots, and (distinct) in names
_CONTRACT_SUFFIX = {SAME: "", DISTINCT: f"-{SHORT[DISTINCT]}"}
HTTP = "http"  # the benchmark over HTTP: its cells' prefix


def suffix(kernels: str) -> str:
    return "" if kernels == "torch" else f"-{kernels}"


def kernels_of(suffix_: str) -> str:
    """The decode path a run-name suffix stands for (the `kernels` wildcard: "", "-triton", "-graph")."""
    return suffix_.removeprefix("-") or "torch"


def run_name(backend: str, kernels: str = "torch") -> str:
    """How evidence names one run. transformers' paths (HF_PATHS) are its own whatever the engine's is: no suffix."""
    return backend if backend in HF_PATHS else backend + suffix(kernels)


def label(backend: str, kernels: str, batch: int, prompts: str = SAME) -> str:
    """One batch size of a run, as its file is named: `<run name>-b<B>`; a distinct-prompts bench cell
    `<run name>-distinct-b<B>`."""
    return f"{run_name(backend, kernels)}{_CONTRACT_SUFFIX[prompts]}-b{batch}"


def bench_contracts(bench: dict) -> tuple[str, ...]:
    """The prompt contracts a campaign's bench section runs: same-prompt, and distinct-prompts where it gives
    `prompts`."""
    return (SAME, DISTINCT) if bench.get("prompts") else (SAME,)


def prompt_texts(bench: dict, rows: int, prompts: str) -> list[str]:
    """Each row's (or request's) prompt under a contract: bench.prompt on every one, or bench.prompts[r] on row r."""
    return [bench["prompt"]] * rows if prompts == SAME else list(bench["prompts"][:rows])


def prompt_keys(texts: list[str], ids: list[list[int]], prompts: str) -> dict:
    """A cell contract's prompt keys, the same for the in-process and the HTTP bench (so that the builtin engine's
    cells stand beside each other: benchstats.SIDE_BY_SIDE_KEYS). Same-prompt keeps the keys it always had, so that
    its cells compare with earlier evidence's."""
    if prompts == SAME:
        return {"prompt_sha256": sha256_bytes(texts[0].encode()), "prompt_tokens": len(ids[0])}
    return {"prompts_sha256": sha256_bytes(json.dumps(texts).encode()), "prompt_tokens": [len(i) for i in ids]}


def bench_cell(backend: str, batch: int, prompts: str = SAME) -> str:
    """A bench cell's file under bench/, without `.json`: `<backend>[-distinct]-b<B>` (the decode path is the
    campaign's bench.kernels, recorded in the cell): the torch path's label."""
    return label(backend, "torch", batch, prompts)


def cell_prompts(cell: dict) -> str:
    """A bench cell record's prompt contract; a record without one predates distinct prompts: same-prompt."""
    contract = cell.get("contract")
    return contract.get("prompts", SAME) if isinstance(contract, dict) else SAME


def cell_label(cell: dict, kernels: str = "torch") -> str:
    """The label of a bench cell record (`label`; an HTTP cell's, `http_cell`); `kernels` where the record names
    none."""
    if is_http(cell):
        return http_cell(str(cell["target"]), int(cell["concurrency"]), cell_prompts(cell))
    if is_rate(cell):
        return rate_cell(str(cell["target"]), float(cell["rate"]))
    return label(str(cell["backend"]), str(cell.get("kernels") or kernels), int(cell["batch"]), cell_prompts(cell))


def http_cell(target: str, concurrency: int, prompts: str = SAME) -> str:
    """A cell of the benchmark over HTTP, as its file under bench/ is named and its label reads:
    `http-<target>[-distinct]-c<C>`."""
    return f"{HTTP}-{target}{_CONTRACT_SUFFIX[prompts]}-c{concurrency}"


def rate_cell(target: str, rate: float) -> str:
    """A cell of the rate rung (`bench.http.rates`), as its file under bench/ is named and its label reads:
    `http-<target>-r<R>`, R as written shortest (2, 0.5)."""
    return f"{HTTP}-{target}-r{float(rate):g}"


def is_rate(cell) -> bool:
    """A cell record of the rate rung (a target and a rate, no concurrency)."""
    return isinstance(cell, dict) and "rate" in cell and "target" in cell and "concurrency" not in cell


def is_http(cell) -> bool:
    """A cell record of the benchmark over HTTP (it has a target and a concurrency, no backend and batch)."""
    return isinstance(cell, dict) and "concurrency" in cell and "target" in cell


def label_key(name: str) -> tuple:
    """Orders labels by run name, then by batch, concurrency or rate as a number (`single-b8` before `single-b16`,
    `http-engine-c4` before `http-engine-c16`, `http-engine-r0.5` before `http-engine-r2`, every `c` before any `r`)."""
    m = re.fullmatch(r"(.*)-([bcr])(\d+(?:\.\d+)?)", name)
    return (m.group(1), m.group(2), float(m.group(3)), name) if m else (name, "", 0, name)  # concurrencies, then rates


def wildcard_constraints(backends: tuple[str, ...]) -> dict[str, str]:
    """The `backend` and `kernels` wildcards of a rule's output `.../{backend}{kernels}-b<B>.json` (a rule
    without the `kernels` wildcard ignores its constraint)."""
    return {"backend": "|".join(map(re.escape, backends)),
            "kernels": "|".join(re.escape(suffix(k)) for k in KERNELS)}
