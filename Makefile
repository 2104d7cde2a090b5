# The project's commands. `make test` is THE test command (README).
#   make test PYTEST_ARGS='-k reaper -x'     run the suite (bootstraps .venv first)
#   make lint                                ruff over the code and the tests
#   make demo MODE=plain                     the demo with plain Celery tasks, for comparison
#   make bench                               run every benchmark in bench/

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := test,postgres,mysql,metrics
# ruff fails on a path that does not exist; lint the ones that do.
LINT_PATHS := $(wildcard celery_lease tests tools bench example_project)

.PHONY: venv test lint demo bench settings-table clean

venv: $(STAMP)

# Re-installed only when the package metadata changes.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

demo: $(STAMP)
	$(PY) -m example_project.demo $(if $(MODE),--mode $(MODE))

# Each bench/NAME.py runs as `python -m bench.NAME` from the root (files named _*.py are helpers).
bench: $(STAMP)
	@set -e; found=0; for f in bench/*.py; do \
	    case "$$(basename $$f)" in _*) continue ;; esac; \
	    [ -f "$$f" ] || continue; found=1; \
	    echo "== $$f"; $(PY) -m bench.$$(basename $$f .py); \
	done; [ $$found = 1 ] || echo "no benchmarks in bench/"

# Rewrite the settings table in README.md from celery_lease.config.SETTINGS.
settings-table: $(STAMP)
	$(PY) tools/settings_table.py --write README.md

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
