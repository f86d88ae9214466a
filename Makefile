# Two commands do all set-up: `make demo` (main job) and `make test`.
PY := .venv/bin/python

.PHONY: install demo test
install:
	@bash scripts/install.sh

demo: install
	$(PY) scripts/demo.py $(ARGS)

test: install
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)
