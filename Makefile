# Two entry points for a fresh machine with only Python 3.11+:
#   make up    -- create .venv, install, run `iop-trio up` (edge + one mock node, mTLS on)
#   make test  -- create .venv, install with test extras, lint (ruff, mypy), run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: up test lint venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

venv: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'

up: venv
	$(BIN)/iop-trio up

test: venv
	$(BIN)/ruff check iop_trio tests
	$(BIN)/mypy iop_trio
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check iop_trio tests
	$(BIN)/mypy iop_trio
