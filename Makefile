# sqla_delayedq: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= dev,spark
DEMO_DB ?= demo.sqlite

# `make demo` needs only the package itself (SQLAlchemy, Alembic, SQLite from the standard
# library); `make install` adds every extra to the same virtualenv.
FULL := $(VENV)/.installed-$(EXTRAS)
CORE := $(VENV)/.installed-core

.DEFAULT_GOAL := help
.PHONY: help install demo test lint docs docs-serve bench dist clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  %-10s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(FULL): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

$(CORE): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

install: $(FULL) ## create the virtualenv and install the package with every extra (dev, spark)

demo: $(CORE) ## install the package alone (no extras), migrate a SQLite file, enqueue with a domain write, run a worker
	rm -f $(DEMO_DB) $(DEMO_DB)-wal $(DEMO_DB)-shm
	DELAYEDQ_DATABASE_URL=sqlite:///$(DEMO_DB) $(BIN)/alembic upgrade head
	$(BIN)/python examples/demo.py sqlite:///$(DEMO_DB)

test: install ## run the whole test suite (PostgreSQL and MariaDB required when CI=true)
	$(BIN)/python -m pytest

lint: install ## ruff, mypy (strict on the package, relaxed on the tests) and the architecture rules
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python scripts/check_architecture.py

docs: install ## build the documentation site into site/ in strict mode (any warning fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean

docs-serve: install ## serve the documentation site on http://127.0.0.1:8000 with live reload
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

BENCH := $(VENV)/.installed-bench

$(BENCH): pyproject.toml $(FULL)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	touch $@

bench: install $(BENCH) ## run the benchmarks (ours, the peers procrastinate and pgqueuer, hand-written SQL) against the local servers; writes bench/results.json
	$(BIN)/python -m bench

dist: install ## build the sdist and the wheel into dist/; fails on a packaging deprecation warning
	rm -rf dist
	$(BIN)/python -m build --outdir dist . > dist.log 2>&1 || { cat dist.log; exit 1; }
	@! grep -i 'deprecat' dist.log || { echo "deprecation warnings in the build log: dist.log"; exit 1; }
	@ls -l dist

clean: ## remove the virtualenv and local artefacts
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache build dist dist.log *.egg-info $(DEMO_DB) $(DEMO_DB)-wal $(DEMO_DB)-shm
