# The project's commands. `make test` is THE test command (README).
#   make test PYTEST_ARGS='-k reaper -x'     run the suite (bootstraps .venv first)
#   make lint                                ruff over the code and the tests, mypy over the package, the layer contracts
#   make mindeps                             unit and broker tests on the lowest versions setup.cfg admits
#   make demo MODE=plain                     the demo with plain Celery tasks, for comparison
#   make bench                               run every benchmark in bench/
#   make screenshots                         the web page's pictures in docs/img (needs chromium)
#   make test-celery                         Celery's own integration tests with task_cls LeaseTask

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := test,redis,postgres,mysql,metrics,web
# A second venv with the dependency floors (tools/mindeps-requirements.txt).
MINDEPS := .venv-mindeps
MINDEPS_STAMP := $(MINDEPS)/.installed
MINDEPS_TESTS := tests/unit tests/integration/test_redis_visibility.py tests/integration/test_rabbitmq.py
# ruff fails on a path that does not exist; lint the ones that do.
LINT_PATHS := $(wildcard celery_lease tests tools bench example_project)

.PHONY: venv test lint mindeps test-celery test-celery-ci test-celery-baseline demo bench bench-tables settings-table \
	screenshots clean

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
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

$(MINDEPS_STAMP): setup.cfg pyproject.toml tools/mindeps-requirements.txt
	test -x $(MINDEPS)/bin/python || $(PYTHON) -m venv $(MINDEPS)
	$(MINDEPS)/bin/python -m pip install --quiet --upgrade pip
	$(MINDEPS)/bin/python -m pip install --quiet -r tools/mindeps-requirements.txt
	$(MINDEPS)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

# The store-parametrized tests and the operator scenes run on PostgreSQL here (the driver whose
# floor matters most: the store's bounded calls need psycopg's wait timeout); `make test` covers
# SQLite and MariaDB.
mindeps: $(MINDEPS_STAMP)
	CELERY_LEASE_TEST_STORES=$${CELERY_LEASE_TEST_STORES:-postgres} \
	    $(MINDEPS)/bin/python -m pytest -q $(MINDEPS_TESTS) $(PYTEST_ARGS)

# Celery's own integration tests (test_tasks, test_canvas, test_inspect, test_group_chains from
# the sdist of the Celery in .venv) with every app's task_cls LeaseTask, in a venv of their own
# (.venv-celery); the run fails when a test on plain Celery's pass list for that version
# (tools/celery_suite/pass-<version>.txt) does not pass. CELERY_SUITE_TASK_CLS=plain runs them
# with celery.Task; test-celery-ci runs the subset CI has time for; test-celery-baseline
# (re)writes the pass list with plain Celery.
test-celery: $(STAMP)
	$(PY) tools/celery_suite/run.py $(PYTEST_ARGS)

test-celery-ci: $(STAMP)
	$(PY) tools/celery_suite/run.py --subset ci $(PYTEST_ARGS)

test-celery-baseline: $(STAMP)
	CELERY_SUITE_TASK_CLS=plain $(PY) tools/celery_suite/run.py --record $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m example_project.demo $(if $(MODE),--mode $(MODE))

# Each bench/NAME.py runs as `python -m bench.NAME` from the root (files named _*.py are helpers).
# The ones that save figures (bench/results/) then have docs/costs.md's cost tables rewritten.
bench: $(STAMP)
	@set -e; found=0; for f in bench/*.py; do \
	    case "$$(basename $$f)" in _*) continue ;; esac; \
	    [ -f "$$f" ] || continue; found=1; \
	    save=; grep -q -- '"--save"' "$$f" && save=--save; \
	    echo "== $$f"; $(PY) -m bench.$$(basename $$f .py) $$save; \
	done; [ $$found = 1 ] || echo "no benchmarks in bench/"
	$(MAKE) bench-tables

# Rewrite docs/costs.md's cost tables from the figures the benchmarks saved in bench/results/.
bench-tables: $(STAMP)
	$(PY) tools/bench_tables.py --write docs/costs.md

# Rewrite the settings table in README.md from celery_lease.config.SETTINGS.
settings-table: $(STAMP)
	$(PY) tools/settings_table.py --write README.md

# Pictures of `celery lease web`'s pages for docs/operators.md (Debian's chromium through Playwright).
screenshots: $(STAMP)
	$(PY) tools/screenshots.py --out docs/img

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
