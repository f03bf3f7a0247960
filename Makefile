# kfvision — run `make help` for the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= build/demo

.DEFAULT_GOAL := help

.PHONY: help setup demo test test-fast lint bench clean

help: ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install kfvision with pinned versions (constraints.txt)

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

demo: setup ## digits data -> convert -> model -> train -> score on this machine, prints val top-1
	$(VENV)/bin/kfvision demo --out $(DEMO_DIR)

test: setup ## run the whole test suite (what CI runs)
	$(PY) -m pytest

test-fast: setup ## the suite without slow and distributed tests
	$(PY) -m pytest -m "not slow and not distributed"

lint: setup ## ruff
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup ## throughput: kfvision train vs a hand-written loop (ratios, same run)
	$(PY) -m bench.digits

clean: ## remove build outputs (keeps .venv)
	rm -rf build .pytest_cache
