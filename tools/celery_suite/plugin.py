"""pytest plugin that runs Celery's integration tests (t/integration) with LeaseTask.

Loaded with ``-p celery_suite.plugin`` from the unpacked Celery sdist (tools/celery_suite/run.py
does it). ``CELERY_SUITE_TASK_CLS`` picks the mode:

- ``lease`` (default): every app the suite builds (the session worker's and each test's) gets
  ``task_cls="celery_lease:LeaseTask"`` and a lease store (``CELERY_SUITE_STORE``, default the
  local PostgreSQL, tables prefixed ``celery_suite_``, dropped and created at session start);
- ``plain``: Celery's own ``celery.Task``; celery_lease is not even imported.

Celery's conftest defines ``celery_config``, and ``celery_parameters`` comes from
``celery.contrib.pytest``; both return a dict that each app is built from, so this plugin adds
its settings to those dicts as the fixtures are set up, whichever definition pytest chose.

``--celery-suite-record PATH`` writes the node ids of the tests that passed (or xpassed: a
declared failure that did not fail) to PATH: the pass list. ``--celery-suite-expect PATH``
compares with such a list: the session fails, listing them, when a test on the list ran and
did not pass, and succeeds otherwise (tests off the list fail with plain Celery too).
``--celery-suite-differences PATH`` deselects the tests listed there: the known differences of
LeaseTask, each explained in docs/celery.md ("Celery's own integration tests").
``--celery-suite-racy PATH`` gives the tests listed there Celery's own @flaky reruns, in both
modes: tests whose race is in the test itself, whatever the task class.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MODE_ENV = "CELERY_SUITE_TASK_CLS"
MODES = ("lease", "plain")
STORE_ENV = "CELERY_SUITE_STORE"
DEFAULT_STORE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TABLE_PREFIX = "celery_suite_"
LEASE_TASK = "celery_lease:LeaseTask"
#: The rerun marking of Celery's own @flaky tests (t/integration/test_tasks.py).
RACY_RERUNS = {"reruns": 5, "reruns_delay": 2}
#: Outcomes that count as a pass: the test's body ran to its end without an error.
GOOD = ("passed", "xpassed")
PASS_LIST_HEADER = """\
# Celery's integration tests that pass with task_cls {task_cls} (passed, or
# xpassed: a declared failure that did not fail), written by `make test-celery-baseline`
# (tools/celery_suite).
"""


def mode() -> str:
    value = os.environ.get(MODE_ENV, "lease")
    if value not in MODES:
        raise pytest.UsageError(f"{MODE_ENV}={value!r}: must be one of {', '.join(MODES)}")
    return value


def lease_settings() -> dict[str, Any]:
    """The settings every app gets in lease mode: the store, nothing else."""
    return {"lease_store_url": os.environ.get(STORE_ENV, DEFAULT_STORE), "lease_table_prefix": TABLE_PREFIX}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery_suite", "Celery's integration tests under LeaseTask")
    group.addoption("--celery-suite-record", metavar="PATH",
                    help="write the node ids that passed (or xpassed) to PATH")
    group.addoption("--celery-suite-expect", metavar="PATH",
                    help="fail when a test listed in PATH ran and did not pass")
    group.addoption("--celery-suite-differences", metavar="PATH",
                    help="deselect the known differences listed in PATH")
    group.addoption("--celery-suite-racy", metavar="PATH",
                    help="rerun the tests listed in PATH as Celery reruns its @flaky tests")


@pytest.fixture(autouse=True)
def celery_suite_worker(request: pytest.FixtureRequest) -> None:
    """Start Celery's session worker before the first test, whichever tests were selected.

    A few of Celery's tests send tasks without asking for the worker (test_trace_log_arguments)
    and pass only after an earlier test started it: this keeps any selection self-contained.
    """
    request.getfixturevalue("celery_session_worker")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuitePlugin(config, mode()), "celery_suite_session")


def _fresh_store() -> None:
    """Drop the suite's tables and create them at the newest revision: each run starts empty."""
    from celery import Celery

    from celery_lease.store import for_app

    app = Celery("celery_suite_store", set_as_current=False)
    app.conf.update(lease_settings())
    store = for_app(app, check=False, operator=True)
    try:
        store.drop_schema()
        store.ensure_schema(create=True)
    finally:
        store.engine.dispose()


class SuitePlugin:
    """Configures the apps for the mode; records and compares the outcome of each test."""

    def __init__(self, config: pytest.Config, mode: str) -> None:
        self.config = config
        self.mode = mode
        self.outcomes: dict[str, str] = {}
        self.selected: list[str] = []
        self.differences: list[tuple[str, str]] = []
        self.known: list[str] = []
        self.compared = 0

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.mode == "lease":
            _fresh_store()

    def pytest_report_header(self) -> str:
        if self.mode == "plain":
            return "celery suite: task_cls celery.Task (plain)"
        return f"celery suite: task_cls {LEASE_TASK}, store {lease_settings()['lease_store_url']}"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Iterator[None]:
        outcome = yield
        if self.mode != "lease" or fixturedef.argname not in ("celery_config", "celery_parameters"):
            return
        if outcome.excinfo is not None:
            return
        value = outcome.get_result()
        if fixturedef.argname == "celery_config":
            value.update(lease_settings())
        else:
            value["task_cls"] = LEASE_TASK

    @pytest.hookimpl(trylast=True)  # after -k and -m: report only the differences they selected
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        racy = config.getoption("celery_suite_racy")
        if racy:
            listed = read_list(Path(racy))
            for item in items:
                if item.nodeid in listed and item.get_closest_marker("flaky") is None:
                    item.add_marker(pytest.mark.flaky(**RACY_RERUNS))
        path = config.getoption("celery_suite_differences")
        if not path:
            return
        known = read_list(Path(path))
        self.known = [item.nodeid for item in items if item.nodeid in known]
        if self.known:
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid in known])
            items[:] = [item for item in items if item.nodeid not in known]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.selected = [item.nodeid for item in session.items]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == "rerun":  # pytest-rerunfailures: the attempt starts over
            self.outcomes.pop(report.nodeid, None)
            return
        current = self.outcomes.get(report.nodeid)
        if report.when == "setup":
            current = _phase_outcome(report) if not report.passed else None
        elif report.when == "call":
            current = _phase_outcome(report)
        elif report.failed:  # teardown
            current = "error"
        if current is not None:
            self.outcomes[report.nodeid] = current

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        record = self.config.getoption("celery_suite_record")
        expect = self.config.getoption("celery_suite_expect")
        if record:
            good = sorted(n for n in self.selected if self.outcomes.get(n) in GOOD)
            Path(record).write_text(PASS_LIST_HEADER.format(task_cls=self._task_cls())
                                    + "".join(f"{n}\n" for n in good))
        if expect:
            listed = read_list(Path(expect))
            ran = [n for n in self.selected if n in listed]
            self.compared = len(ran)
            self.differences = [(n, self.outcomes.get(n, "not run")) for n in ran
                                if self.outcomes.get(n) not in GOOD]
            # Tests off the list fail with plain Celery as well: only a difference fails the run.
            session.exitstatus = pytest.ExitCode.TESTS_FAILED if self.differences else pytest.ExitCode.OK

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.config.getoption("celery_suite_expect"):
            return
        tr = terminalreporter
        tr.section(f"celery suite: {self._task_cls()} against the pass list")
        if self.differences:
            tr.write_line(f"{len(self.differences)} of {self.compared} tests on the pass list did not pass:",
                          red=True)
            for nodeid, outcome in self.differences:
                tr.write_line(f"  {outcome:8} {nodeid}")
        else:
            tr.write_line(f"all {self.compared} tests on the pass list passed", green=True)
        if self.known:
            tr.write_line(f"{len(self.known)} known differences deselected (docs/celery.md, \"Celery's own "
                          "integration tests\"):")
            for nodeid in self.known:
                tr.write_line(f"  {nodeid}")

    def _task_cls(self) -> str:
        return LEASE_TASK if self.mode == "lease" else "celery.Task"


def _phase_outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


def read_list(path: Path) -> set[str]:
    """The node ids listed in a file: one per line, `` #`` starts a comment."""
    lines = (line.split(" #", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}
