# Two commands set up a fresh machine: `make test` and `make demo`. Both create .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Paddle forces OMP_NUM_THREADS=1 when it is unset; use the machine's cores.
export OMP_NUM_THREADS ?= $(shell nproc 2>/dev/null || echo 2)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20 tests

demo: $(STAMP)
	$(BIN)/gptc demo

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo_out
