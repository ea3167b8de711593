# sqla_delayedq: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= dev,spark
DEMO_DB ?= demo.sqlite

.DEFAULT_GOAL := help
.PHONY: help install demo test test-fast lint typecheck bench clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  %-10s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-$(EXTRAS): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed-$(EXTRAS) ## create the virtualenv and install the package with its extras

demo: install ## migrate a SQLite file, enqueue with a domain write, run a worker, show deliveries
	rm -f $(DEMO_DB) $(DEMO_DB)-wal $(DEMO_DB)-shm
	DELAYEDQ_DATABASE_URL=sqlite:///$(DEMO_DB) $(BIN)/alembic upgrade head
	$(BIN)/python examples/demo.py sqlite:///$(DEMO_DB)

test: install ## run the whole test suite (PostgreSQL and MariaDB required when CI=true)
	$(BIN)/python -m pytest

lint: install ## ruff and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install ## run the benchmarks against the local servers; writes bench/results.json
	$(BIN)/python -m bench

clean: ## remove the virtualenv and local artefacts
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache $(DEMO_DB) $(DEMO_DB)-wal $(DEMO_DB)-shm
