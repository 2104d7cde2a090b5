"""The lease store's PostgreSQL SIGKILLed (postmaster and every backend) mid-run, then restarted.

A private cluster on a free port and a private Redis broker; one threads worker (-c 4) runs 32
jobs of three steps (an effect and a checkpoint each, tests/apps/crash_app.py), the reaper runs
every second in the test process. Lease 3 s, heartbeat 0.5 s, grace 0.5 s, dispatch timeout 2 s
(a pending job whose message is gone is re-sent).

- Down for less than half a lease: every lease outlives the outage, so no body runs again and
  nothing is reaped or taken over.
- Down for twice a lease: the bodies under way lose their leases on their own clocks; each one
  that had not finished runs once more (resuming from its checkpoint), the others do not.

Either way no job ends ``failed``, none finishes twice, and each effect key is acted on once.
The outage lasts a chosen time: that is the test's input, not a wait for some state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from tests.crash.crash_env import (
    APP,
    RECOVERY_EVENTS,
    CrashEnv,
    assert_each_effect_once,
    assert_one_owner_at_a_time,
)
from tests.helpers import wait_for
from tests.reaper_env import reaper_loop
from tests.servers import servers
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.slow]

LEASE = 3.0
JOBS = 32
OUTAGES = {"short": LEASE / 4, "long": 2 * LEASE}  # both longer than a step's 0.3 s pause


def outage(pg, seconds: float) -> tuple[float, float]:
    """SIGKILL the whole server, keep it down ``seconds``, restart it; (wall time when all its
    processes were gone, seconds down)."""
    began = time.monotonic()
    pg.kill()
    killed_at = time.time()
    assert pg.pids() == [], "a server process survived SIGKILL"
    while time.monotonic() < began + seconds:  # the outage's length is the test's input
        time.sleep(0.05)
    pg.start()
    return killed_at, time.monotonic() - began


@dataclass
class Outcome:
    env: CrashEnv
    ids: list[str]
    running: set[str]  # jobs with a body under way at the kill
    killed_at: float
    down: float
    events: list[tuple[str, str, str]]


def run_through_an_outage(tmp_path, seconds: float) -> Outcome:
    """32 jobs, the store killed when some have finished and some are under way; all done after."""
    with servers(tmp_path) as own:
        pg, broker = own.postgres(), own.redis()
        env = CrashEnv(tmp_path, pg.url(), broker.url())
        app = env.app()
        try:
            with celery_processes(tmp_path) as procs, reaper_loop(app, interval=1.0):
                procs.append(worker(APP, env.env(), tmp_path, pool="threads", concurrency=4, name="crashw"))
                ids = env.publish(app, JOBS)
                wait_for(lambda: env.finished() >= 4 and len(env.running()) >= 3, timeout=60,
                         message="the worker never had jobs under way")
                killed_at, down = outage(pg, seconds)
                wait_for(lambda: env.all_completed(ids), timeout=90, interval=0.25,
                         message="not every job completed after the restart")
                events = env.recovery_events()
        finally:
            env.close()
    return Outcome(env, ids, env.running(at=killed_at), killed_at, down, events)


def test_a_store_killed_for_less_than_half_a_lease_runs_no_body_twice_and_reaps_nothing(tmp_path):
    out = run_through_an_outage(tmp_path, OUTAGES["short"])
    env, ids, running, down = out.env, out.ids, out.running, out.down
    runs = env.executions()
    assert down < LEASE / 2, f"the restart took too long for this case: down {down:.2f} s"
    # Given bodies under way when the server died, some of which went on after it came back
    assert running, "no body was under way at the kill"
    assert any(line.at > out.killed_at + down for job in running for e in runs[job] for line in e.lines)
    # Then each job ran its body once, finished once, and nothing was recovered
    assert {job: len(runs[job]) for job in ids} == dict.fromkeys(ids, 1)
    assert {job: sum(e.finished for e in runs[job]) for job in ids} == dict.fromkeys(ids, 1)
    assert out.events == [], f"recovery events ({', '.join(RECOVERY_EVENTS)}) after a short outage"
    assert_each_effect_once(env, ids)


def test_a_store_killed_for_twice_a_lease_runs_each_interrupted_body_once_more(tmp_path):
    out = run_through_an_outage(tmp_path, OUTAGES["long"])
    env, ids, running, down = out.env, out.ids, out.running, out.down
    runs = env.executions()
    assert down >= 2 * LEASE
    # Given bodies that were under way at the kill and had not finished their first run
    interrupted = {job for job in ids if not runs[job][0].finished}
    assert interrupted, f"no body was interrupted (under way at the kill: {sorted(running)})"
    assert interrupted <= running, (interrupted, running)
    # Then each interrupted body ran exactly once more, every other job once, each finished once
    assert {job: len(runs[job]) for job in ids} == {job: 1 + (job in interrupted) for job in ids}
    assert {job: sum(e.finished for e in runs[job]) for job in ids} == dict.fromkeys(ids, 1)
    assert [e for e in out.events if e[0] in ("failed", "dead_lettered")] == []
    assert_each_effect_once(env, ids)
    assert_one_owner_at_a_time(runs)
