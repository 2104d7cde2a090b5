"""tools/celery_suite/plugin.py: the apps get LeaseTask and a store; the pass list gates the run.

Each test runs a small stand-in for Celery's integration suite (a conftest with the fixtures
the plugin adjusts) in a pytest of its own, as ``make test-celery`` runs Celery's tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parents[2]

# The fixtures of Celery's integration conftest and celery.contrib.pytest that the plugin
# touches; the session worker is a stand-in that starts nothing.
CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def celery_config():
    return {"broker_url": "memory://"}

@pytest.fixture(scope="session")
def celery_parameters():
    return {}

@pytest.fixture(scope="session")
def celery_session_worker():
    return "worker"
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.Pytester:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.setenv("CELERY_SUITE_STORE", f"sqlite:///{tmp_path / 'suite.sqlite3'}")
    monkeypatch.setenv("CELERY_SUITE_TASK_CLS", "plain")  # the lease test sets "lease"
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # pytest-celery's Docker plugin too
    pytester.makeconftest(CONFTEST)
    return pytester


def run(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    return suite.runpytest("-p", "celery_suite.plugin", *args)


OUTCOMES = """
import pytest

def test_passes():
    pass

def test_fails():
    assert False

@pytest.mark.xfail(reason="declared", strict=False)
def test_xpasses():
    pass

@pytest.mark.xfail(reason="declared")
def test_xfails():
    assert False
"""


def test_lease_mode_gives_each_app_lease_task_and_the_suite_store(suite, monkeypatch):
    monkeypatch.delenv("CELERY_SUITE_TASK_CLS")  # lease is the default
    suite.makepyfile(test_apps="""
        def test_config(celery_config, celery_parameters):
            assert celery_config["lease_store_url"].startswith("sqlite:///")
            assert celery_config["lease_table_prefix"] == "celery_suite_"
            assert celery_config["broker_url"] == "memory://"
            assert celery_parameters == {"task_cls": "celery_lease:LeaseTask"}
    """)

    run(suite).assert_outcomes(passed=1)


def test_plain_mode_leaves_the_apps_as_celery_builds_them(suite, monkeypatch):
    monkeypatch.setenv("CELERY_SUITE_TASK_CLS", "plain")
    suite.makepyfile(test_apps="""
        def test_config(celery_config, celery_parameters):
            assert celery_config == {"broker_url": "memory://"}
            assert celery_parameters == {}
    """)

    run(suite).assert_outcomes(passed=1)


def test_an_unknown_mode_is_refused(suite, monkeypatch):
    monkeypatch.setenv("CELERY_SUITE_TASK_CLS", "lease-task")
    suite.makepyfile(test_apps="def test_nothing(): pass")

    result = run(suite)

    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*CELERY_SUITE_TASK_CLS='lease-task': must be one of lease, plain*"])


def test_record_lists_the_tests_that_passed_or_xpassed(suite, tmp_path):
    suite.makepyfile(test_outcomes=OUTCOMES)
    listed = tmp_path / "pass.txt"

    run(suite, f"--celery-suite-record={listed}")

    ids = [line for line in listed.read_text().splitlines() if not line.startswith("#")]
    assert ids == ["test_outcomes.py::test_passes", "test_outcomes.py::test_xpasses"]


def test_a_listed_test_that_fails_fails_the_run_and_is_named(suite, tmp_path):
    suite.makepyfile(test_outcomes=OUTCOMES)
    listed = tmp_path / "pass.txt"
    listed.write_text("# header\ntest_outcomes.py::test_passes\ntest_outcomes.py::test_fails\n")

    result = run(suite, f"--celery-suite-expect={listed}")

    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["1 of 2 tests on the pass list did not pass:",
                                 "  failed   test_outcomes.py::test_fails"])


def test_failures_off_the_list_do_not_fail_the_run(suite, tmp_path):
    suite.makepyfile(test_outcomes=OUTCOMES)
    listed = tmp_path / "pass.txt"
    listed.write_text("test_outcomes.py::test_passes\ntest_outcomes.py::test_xpasses\n")

    result = run(suite, f"--celery-suite-expect={listed}")

    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["all 2 tests on the pass list passed"])


def test_known_differences_are_deselected_and_named(suite, tmp_path):
    suite.makepyfile(test_outcomes=OUTCOMES)
    listed = tmp_path / "pass.txt"
    listed.write_text("test_outcomes.py::test_passes\ntest_outcomes.py::test_fails\n")
    known = tmp_path / "differences.txt"
    known.write_text("# why\ntest_outcomes.py::test_fails  # a reason\n")

    result = run(suite, f"--celery-suite-expect={listed}", f"--celery-suite-differences={known}")

    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, xpassed=1, xfailed=1, deselected=1)
    result.stdout.fnmatch_lines(["1 known differences deselected*", "  test_outcomes.py::test_fails"])


RERUN_MARKS = """
import pytest

def test_racy(request):
    mark = request.node.get_closest_marker("flaky")
    assert mark is not None and mark.kwargs == {"reruns": 5, "reruns_delay": 2}

@pytest.mark.flaky(reruns=1)
def test_racy_marked_by_celery(request):
    assert request.node.get_closest_marker("flaky").kwargs == {"reruns": 1}

def test_not_listed(request):
    assert request.node.get_closest_marker("flaky") is None
"""


@pytest.mark.parametrize("mode", ["lease", "plain"])
def test_racy_tests_get_celerys_flaky_reruns_in_both_modes_and_keep_their_own(suite, tmp_path,
                                                                                monkeypatch, mode):
    monkeypatch.setenv("CELERY_SUITE_TASK_CLS", mode)
    suite.makepyfile(test_marks=RERUN_MARKS)
    racy = tmp_path / "racy.txt"
    racy.write_text("# the race\ntest_marks.py::test_racy\ntest_marks.py::test_racy_marked_by_celery\n")

    # The flaky mark as pytest-rerunfailures declares it; the plugin itself is not needed here.
    result = run(suite, "-p", "no:rerunfailures", "-o", "markers=flaky: rerun", f"--celery-suite-racy={racy}")

    result.assert_outcomes(passed=3)


def test_the_racy_list_names_only_tests_on_the_pass_list(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from celery_suite.plugin import read_list

    suite_dir = ROOT / "tools" / "celery_suite"
    racy = read_list(suite_dir / "racy.txt")
    passing = set().union(*(read_list(p) for p in suite_dir.glob("pass-*.txt")))
    assert racy and racy <= passing
