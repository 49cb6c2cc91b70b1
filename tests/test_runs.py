"""Run identity (workflow/plan/runs.py): one enum, one name, wildcards that parse every name back."""

import re

import pytest

from evident.engine import parallel
from evident.workflow.plan import runs


def test_the_engine_transports_are_the_schemas_expert_parallel_backends():
    assert runs.EP_BACKENDS == parallel.BACKENDS
    assert runs.BACKENDS == ("single", *parallel.BACKENDS)
    assert set(runs.BENCH_BACKENDS) == {*runs.BACKENDS, *runs.HF_PATHS} and runs.HF in runs.HF_PATHS


@pytest.mark.parametrize("backend", runs.BACKENDS)
@pytest.mark.parametrize("kernels", runs.KERNELS)
def test_the_wildcards_parse_every_run_name_back(backend, kernels):
    c = runs.wildcard_constraints(runs.BACKENDS)
    pattern = re.compile(rf"(?P<backend>{c['backend']})(?P<kernels>{c['kernels']})-b(?P<batch>\d+)")
    m = pattern.fullmatch(runs.label(backend, kernels, 8))
    assert m and m["backend"] == backend and runs.kernels_of(m["kernels"]) == kernels and m["batch"] == "8"


def test_names():
    assert runs.run_name("single") == "single"
    assert runs.run_name("collective", "graph") == "collective-graph"
    # transformers runs its own path whatever decode path the engine is benchmarked on
    assert runs.run_name(runs.HF, "graph") == "hf" and runs.run_name("hf-static", "graph") == "hf-static"
    assert runs.kernels_of("") == "torch" and runs.kernels_of("-triton") == "triton"


@pytest.mark.parametrize("backend", runs.BENCH_BACKENDS)
def test_the_bench_wildcard_parses_every_cell_name_back(backend):
    c = runs.wildcard_constraints(runs.BENCH_BACKENDS)  # bench/<backend>-b<B>.json: hf-static-b8 is hf-static's
    m = re.compile(rf"(?P<backend>{c['backend']})-b(?P<batch>\d+)").fullmatch(f"{backend}-b8")
    assert m and m["backend"] == backend


def test_labels_order_by_number_and_concurrencies_before_rates():
    names = ["http-engine-r2", "single-b16", "http-engine-c8", "http-engine-r0.5", "single-b8", "http-engine-c16"]
    assert sorted(names, key=runs.label_key) == ["http-engine-c8", "http-engine-c16", "http-engine-r0.5",
                                                 "http-engine-r2", "single-b8", "single-b16"]
