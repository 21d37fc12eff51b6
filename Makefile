# attnx — the two commands: `make demo` (main job end to end) and `make test`.
# Both create ./.venv and install what they need; nothing else must be set up by hand.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
ATTNX   = $(VENV)/bin/attnx
STAMP   = $(VENV)/.attnx-installed
WORK   ?= attnx-out
PYTEST_ARGS ?=

.PHONY: venv test demo plugins bench clean help

help:
	@echo "make demo     - real all-MiniLM-L6-v2 (mha + smal): export -> check -> fp16 engine -> serve -> search"
	@echo "make test     - the test suite (creates .venv, builds the plugins)"
	@echo "make plugins  - compile the TensorRT plugin library (nvcc + CMake)"
	@echo "make bench    - the benchmarks under benchmarks/"

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints-dev.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints-dev.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

plugins: $(STAMP)
	$(ATTNX) plugins build

test: $(STAMP)
	# The attention page is tested in a real browser: Debian's chromium (no Playwright download).
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(ATTNX) plugins build
	$(PY) -m pytest -q $(PYTEST_ARGS)

# DEMO_ARGS: e.g. --variants cultural, --query "...", or --toy for every variant's small random encoder.
DEMO_ARGS ?=
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(ATTNX) demo --workdir $(WORK) $(DEMO_ARGS)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(WORK) plugins/build plugins/lib build *.egg-info
