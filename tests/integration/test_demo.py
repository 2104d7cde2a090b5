"""The demo, end to end, as CI runs it; and the demo's verdict on runs that broke a guarantee.

The end-to-end tests run ``python -m example_project.demo`` exactly as ``make demo`` does:
real ``celery worker`` and ``celery beat`` processes, a SIGKILLed worker, a SIGSTOPped one.
The verdict tests feed the demo's final report a recorded run with one guarantee broken
and check that lease mode exits non-zero for it (and plain mode does not).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT = 150.0  # seconds; `make demo` must finish in under two minutes
REDIS_DB = 11  # the demo's database number (tests/conftest.py: one per test family)


class Demo:
    """One run of ``python -m example_project.demo`` in a subprocess, started now, judged later."""

    def __init__(self, run_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith("EXAMPLE_") and k not in ("CELERY_BROKER_URL", "PYTHONPATH")}
        self.run_dir = run_dir
        self.deadline = time.monotonic() + DEMO_TIMEOUT
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "example_project.demo", "--run-dir", str(run_dir), *args],
            cwd=ROOT, env={**clean, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(self) -> tuple[int, str, dict]:
        """Wait for the run to end; returns (exit status, stdout, result.json)."""
        try:
            out, _ = self.proc.communicate(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)  # the demo kills its workers' process groups on SIGTERM
            out, _ = self.proc.communicate(timeout=20)
            pytest.fail(f"the demo took more than {DEMO_TIMEOUT:g}s; its output:\n{out[-4000:]}")
        result_file = self.run_dir / "result.json"
        assert result_file.exists(), \
            f"the demo wrote no result (exit {self.proc.returncode}):\n{out[-12000:]}"
        return self.proc.returncode, out, json.loads(result_file.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.communicate(timeout=20)


LEASE, PLAIN, SHARED = "lease", "plain", "redis+postgresql"


@pytest.fixture(scope="module")
def demos(request, tmp_path_factory) -> Iterator[dict[str, Demo]]:
    """The demo runs this session's tests want, all started at once.

    A run mostly waits (its task bodies sleep, its reaper runs every second), so three side by
    side take about as long as one; each test then judges its own.
    """
    wanted = {item.originalname for item in request.session.items if item.module.__name__ == __name__}
    runs: dict[str, Demo] = {}
    try:
        if test_demo_lease_mode_recovers_killed_and_frozen_workers_and_loses_nothing.__name__ in wanted:
            runs[LEASE] = Demo(tmp_path_factory.mktemp("lease") / "run")
        if test_demo_plain_mode_shows_the_job_plain_celery_loses_and_exits_zero.__name__ in wanted:
            runs[PLAIN] = Demo(tmp_path_factory.mktemp("plain") / "run", "--mode", "plain")
        if test_demo_runs_on_redis_and_postgresql_with_two_environment_variables.__name__ in wanted:
            try:
                redis_url = request.getfixturevalue("redis_url")
                postgres_url = request.getfixturevalue("postgres_url")
            except (pytest.skip.Exception, pytest.fail.Exception):
                pass  # its test asks for the services itself, and skips or fails there
            else:
                broker = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
                env = {"CELERY_BROKER_URL": broker, "EXAMPLE_LEASE_STORE_URL": postgres_url}
                runs[SHARED] = Demo(tmp_path_factory.mktemp("shared") / "run", env=env)
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.integration
@pytest.mark.chaos
@pytest.mark.slow
def test_demo_lease_mode_recovers_killed_and_frozen_workers_and_loses_nothing(demos):
    status, out, result = demos[LEASE].finish()

    assert status == 0, out[-4000:]
    table = result["table"]
    assert (table["published"], table["completed"], table["lost"], table["failed"]) == (20, 20, 0, 0), out
    # The killed run and the frozen run each started again on another worker.
    assert table["executions"] >= 22, out
    # One card capture, invoice or report per job: the re-runs repeated none.
    assert table["effects"] == 20, out
    # The frozen worker woke up to a lease that had moved on, and was told so.
    assert table["stale_rejected"] >= 1, out
    assert [c["name"] for c in result["checks"] if not c["ok"]] == [], out
    assert result["seconds"] < 120, out
    assert "| lease | 20 | 20 |" in out
    assert "SIGKILL" in out and "SIGSTOP" in out and "SIGCONT" in out
    assert "pending again" in out, "the timeline shows the reaper taking leases back"


@pytest.mark.integration
@pytest.mark.chaos
@pytest.mark.slow
def test_demo_plain_mode_shows_the_job_plain_celery_loses_and_exits_zero(demos):
    status, out, result = demos[PLAIN].finish()

    assert status == 0, out[-4000:]
    table = result["table"]
    assert table["published"] == 20
    assert table["lost"] >= 1 and table["completed"] <= 19, out
    assert (table["duplicates_skipped"], table["stale_rejected"]) == (0, 0)
    broken = {c["name"] for c in result["checks"] if c["ok"] is False}
    assert {"no job lost", "no job stuck"} <= broken, out
    assert "| plain | 20 |" in out
    assert "as expected" in out


@pytest.mark.integration
@pytest.mark.chaos
@pytest.mark.slow
def test_demo_runs_on_redis_and_postgresql_with_two_environment_variables(redis_url, postgres_url, demos):
    broker = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    status, out, result = demos[SHARED].finish()

    assert status == 0, out[-4000:]
    assert f"broker       {broker}" in out
    assert "lease store  postgresql" in out
    table = result["table"]
    assert (table["completed"], table["lost"], table["effects"]) == (20, 0, 20), out
    assert all(c["ok"] for c in result["checks"]), out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc (Linux)")
def test_a_worker_counts_as_stopped_once_every_process_of_its_group_is(tmp_path):
    """The demo freezes a worker inside the SQLite store's write lock until the stop has landed."""
    from example_project.processes import Proc

    # A shell and a child of its own in one new group, as a worker's main process and pool child.
    popen = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60; wait"], start_new_session=True)
    proc = Proc("sh", popen, tmp_path / "log")
    try:
        wait_for(lambda: len(group_states(popen.pid)) == 3, message="the group's three processes")
        assert not proc.stopped()
        proc.signal(signal.SIGSTOP)
        wait_for(proc.stopped, message="every process of the group stopped")
        assert set(group_states(popen.pid)) == {"T"}
        proc.signal(signal.SIGCONT)
        wait_for(lambda: not proc.stopped(), message="the group running again")
    finally:
        proc.kill()


def test_a_scenario_that_cannot_be_played_shows_the_end_of_each_process_log(tmp_path, capsys):
    from example_project.demo import _print_log_tails

    (tmp_path / "w1.log").write_text("".join(f"w1 line {n}\n" for n in range(20)))
    (tmp_path / "reaper.log").write_text("reaper took back rpt-1\n")
    _print_log_tails(tmp_path, lines=8)
    out = capsys.readouterr().out
    assert "last lines of reaper.log" in out and "reaper took back rpt-1" in out
    assert [f"w1 line {n}" for n in range(12, 20)] == [
        line.strip() for line in out.splitlines() if line.strip().startswith("w1 line")]


def group_states(pgrp: int) -> list[str]:
    """The states of the live processes of one process group, from /proc."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgrp and fields[0] not in ("Z", "X"):
            states.append(fields[0])
    return states


# -- the verdict: lease mode exits non-zero when a run broke a guarantee ------------------------
def recorded_run(mode: str = "lease"):
    """A run as the demo records it, in which every guarantee held.

    pay-1's worker was killed mid-job and rpt-1's worker frozen; the reaper took both
    leases back within the bound, the frozen worker's heartbeat was rejected when it woke,
    and every job completed once on w1.
    """
    from example_project.scenario import JOBS, Disruption, Published, Record

    tasks = {"pay": "capture_payment", "order": "issue_invoice", "rpt": "build_report"}
    rec = Record(mode, t0=1000.0, ended_at=1030.0, settled=True)
    for n, label in enumerate(JOBS):
        job_id, token, task = f"job-{n}", f"tok{n:05d}", tasks[label.split("-")[0]]
        rec.jobs.append(Published(job_id, label, task))
        rec.executions.append(dict(id=n + 1, job_id=job_id, label=label, task=task, node="w1", pid=1,
                                   token=token, attempt=1, started_at=1001.0 + n, phase=None, phase_at=None,
                                   finished_at=1001.5 + n, outcome="finished"))
        rec.statuses[job_id] = "completed"
        rec.events.append(dict(id=n, job_id=job_id, event="completed", reason=None, worker="w1@h:1",
                               token=token, at=1001.5 + n, detail=None))
    rec.captures = {label: 1 for label in JOBS if label.startswith("pay-")}
    rec.issued = {"invoices": 8, "reports": 4}
    rec.executions += [
        dict(id=101, job_id="job-0", label="pay-1", task="capture_payment", node="w3", pid=3,
             token="killed01", attempt=1, started_at=1000.2, phase="captured", phase_at=1000.4,
             finished_at=None, outcome=None),
        dict(id=102, job_id="job-1", label="rpt-1", task="build_report", node="w2", pid=2, token="stale001",
             attempt=1, started_at=1000.3, phase="step 1/6", phase_at=1000.9, finished_at=1006.1,
             outcome="LeaseLost"),
    ]
    rec.events += [
        dict(id=201, job_id="job-0", event="reaped_expired_lease", reason="lease expired (owner w3@h:3 gone)",
             worker="w3@h:3", token="killed01", at=1005.0, detail='{"delay": 0.2}'),
        dict(id=202, job_id="job-1", event="reaped_expired_lease", reason="lease expired (owner w2@h:2 gone)",
             worker="w2@h:2", token="stale001", at=1005.5, detail='{"delay": 0.3}'),
        dict(id=203, job_id="job-1", event="lease_lost", reason="now pending", worker="w2@h:2",
             token="stale001", at=1006.0, detail=None),
    ]
    rec.disruptions = [
        Disruption("kill", "w3", "job-0", "pay-1", 1000.5, 101, "killed01"),
        Disruption("stop", "w2", "job-1", "rpt-1", 1001.0, 102, "stale001", resumed_at=1005.8),
    ]
    return rec


def verdict(rec, run_dir: Path) -> tuple[int, dict[str, bool | None]]:
    import time

    from example_project import demo

    status = demo._report(rec, time.monotonic(), run_dir)
    checks = json.loads((run_dir / "result.json").read_text())["checks"]
    return status, {c["name"]: c["ok"] for c in checks}


def test_verdict_of_a_run_that_kept_every_guarantee_is_exit_status_zero(tmp_path, capsys):
    status, checks = verdict(recorded_run(), tmp_path)

    assert status == 0, capsys.readouterr().out
    assert set(checks.values()) == {True}
    assert "| lease | 20 | 20 | 22 | 0 | 1 | 20 | 0 |" in capsys.readouterr().out


def _charge_twice(rec):
    rec.captures["pay-3"] = 2


def _lose_a_job(rec):
    rec.statuses["job-5"] = "pending"
    rec.executions = [r for r in rec.executions if r["job_id"] != "job-5"]


def _finish_a_body_twice(rec):
    rec.executions.append({**rec.executions[7], "id": 300, "token": "other007", "node": "w2"})


def _accept_the_stale_completion(rec):
    rec.events.append(dict(id=300, job_id="job-1", event="completed", reason=None, worker="w2@h:2",
                           token="stale001", at=1006.1, detail=None))


def _recover_late(rec):
    rec.events[-3]["at"] = 1000.5 + 20.0  # pay-1 taken back 20 s after the kill


def _stay_stuck(rec):
    rec.settled = False


@pytest.mark.parametrize(("breakage", "broken"), [
    (_charge_twice, "effects once per key"),
    (_lose_a_job, "no job lost"),
    (_finish_a_body_twice, "no body ran twice to completion"),
    (_accept_the_stale_completion, "stale owners fenced"),
    (_recover_late, "no job stuck"),
    (_stay_stuck, "no job stuck"),
], ids=lambda v: getattr(v, "__name__", v).lstrip("_"))
def test_verdict_of_a_lease_run_that_broke_a_guarantee_is_exit_status_one(tmp_path, capsys, breakage, broken):
    rec = recorded_run()
    breakage(rec)

    status, checks = verdict(rec, tmp_path)

    assert status == 1, capsys.readouterr().out
    assert checks[broken] is False
    assert "BROKEN" in capsys.readouterr().out


def test_verdict_of_a_plain_run_is_exit_status_zero_however_much_broke(tmp_path, capsys):
    rec = recorded_run("plain")
    _lose_a_job(rec)
    _charge_twice(rec)

    status, checks = verdict(rec, tmp_path)

    assert status == 0
    assert checks["no job lost"] is False and checks["effects once per key"] is False
    assert "as expected" in capsys.readouterr().out
