# `make serve` and `make test` work from a fresh clone: they make .venv, install, prepare the
# model, then serve / test. TORCH picks the torch build: the CPU wheel 2.13.0 here; on a CUDA
# machine e.g. `make serve TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" EXTRAS=test,gpu`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
EXTRAS ?= test

.PHONY: serve test lint format model install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip install --quiet --no-deps "text-generation==0.7.0"
	touch $@

install: $(VENV)/.installed

# resolves MODEL_ID (Hub id or folder), or converts the embedded Gemma-3-270M once into a cached folder
model: install
	$(PY) -m launcher.prepare

serve: model
	$(VENV)/bin/switchyard serve

test: model
	$(PY) -m pytest -q -ra

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache
