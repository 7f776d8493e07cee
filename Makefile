# Two commands set up a fresh machine: `make demo` (the runtime with the onnx and report extras)
# and `make test` (the dev extras: every extra plus the test peers). Both create .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# Paddle forces OMP_NUM_THREADS=1 when it is unset; use the machine's cores.
export OMP_NUM_THREADS ?= $(shell nproc 2>/dev/null || echo 2)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: venv test demo bench bench-full peers clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP) $(DEMO_STAMP)

# What `gptc demo` needs: the runtime, ONNX export/runtime and the report's plots (the dev
# environment above includes them).
$(DEMO_STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[onnx,report]"
	touch $(DEMO_STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20 tests

demo: $(DEMO_STAMP)
	$(BIN)/gptc demo

# Adds bench/results/<host>/<date>_<bench>.json for each benchmark, then regenerates the
# performance tables of README.md and docs/performance.md (bench/tables.py); deletes nothing.
# `make bench`: the default set, gpt-bench decode against its peers (sized for 10-15 minutes on 2
# idle cores; the wall time of a run is the `seconds` of its results file);
# `make bench BENCH=train,decode`: a chosen subset; `make bench-full` (BENCH=all): every benchmark,
# hours the first time.
BENCH ?=
bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(if $(BENCH),--only $(BENCH))

bench-full: $(STAMP)
	$(BIN)/python bench/run_all.py --only all

# The llama.cpp peer of bench/decode.py: llama-cpp-python built from source for this CPU
# (GGML_NATIVE: the instruction sets the host has, as ours), and its source unpacked under
# output/peers for llama.cpp's own convert_hf_to_gguf.py. Minutes the first time (a C++ build).
LLAMA_CPP_PYTHON ?= 0.3.36
PEERS_DIR := output/peers
peers: $(STAMP)
	mkdir -p $(PEERS_DIR)
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(PEERS_DIR) llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf $(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(PEERS_DIR)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(BIN)/python -m pip install -q --no-binary llama-cpp-python \
		$(PEERS_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz gguf sentencepiece

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo_out
