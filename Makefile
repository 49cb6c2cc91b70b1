# Quickstart: `make run` (venv, install, default campaign on CPU) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= all

.PHONY: run test ui lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's metadata changes, so a second `make run` costs seconds.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# `evident run` checks the campaign files, then runs snakemake with these arguments.
run: $(VENV)/.installed
	$(BIN)/evident run --cores $(CORES) $(ARGS)

# Two pytest-xdist workers (TEST_WORKERS=0: one process). Each module is one unit of work, end-to-end runs first
# (tests/conftest.py); xdist's own reordering by test count is off, so that order holds.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# MLflow's UI on this directory's store (mlflow.db), on 127.0.0.1; `evident ui` installs it on first use.
ui: $(VENV)/.installed
	$(BIN)/evident ui $(ARGS)

lint: $(VENV)/.installed
	$(BIN)/snakemake --lint

clean:
	rm -rf .snakemake .evident
