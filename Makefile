# Two commands do all set-up: `make demo` (main job) and `make test`.
PY := .venv/bin/python

.PHONY: install demo test test-fast lint
install:
	@bash scripts/install.sh

demo: install
	$(PY) scripts/demo.py $(ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Everything that starts no vLLM engine (a few minutes).
test-fast: install
	$(PY) -m pytest -q -ra -m "not engine" $(PYTEST_ARGS)

test: lint
	$(PY) -m pytest -q -ra --durations=30 $(PYTEST_ARGS)
