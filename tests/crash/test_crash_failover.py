"""Failover: the store's primary SIGKILLed mid-run and its synchronous standby promoted.

Two private clusters: a primary with ``synchronous_standby_names = '*'`` and
``synchronous_commit = on``, and a streaming standby made by ``pg_basebackup -R`` (which
waits for no standby of its own once promoted). The store URL names both hosts with
``target_session_attrs=read-write`` (psycopg's multi-host form, as SQLAlchemy 2.1 passes it
on), so every connection finds whichever is the primary now. One threads worker (-c 4) runs
32 jobs of three steps (tests/apps/crash_app.py), the reaper runs every second in the test
process; lease 3 s, heartbeat 0.5 s. The standby is promoted 1 s after the kill (a failure
detector's delay), so every body under way meets the outage.

Nothing committed is lost with the primary: every job completes, none twice, no effect is
acted on twice, and no body acted on a lease after another body of its job had started.
"""

from __future__ import annotations

import time

import pytest

from tests.crash.crash_env import APP, CrashEnv, assert_each_effect_once, assert_one_owner_at_a_time
from tests.helpers import wait_for
from tests.reaper_env import reaper_loop
from tests.servers import PG_USER, servers
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.slow]

JOBS = 32
LEASE = 3.0
# Seconds from the kill to the promotion (failure detection): past a step's pause, so every body
# under way meets the outage, and under half a lease.
DETECTION = 1.0


def both_hosts_url(primary, standby, db: str = "postgres") -> str:
    """One store URL naming both servers; a connection goes to the one that takes writes."""
    return (f"postgresql+psycopg://{PG_USER}@/{db}?host=127.0.0.1:{primary.port}"
            f"&host=127.0.0.1:{standby.port}&target_session_attrs=read-write")


def test_a_primary_killed_and_its_synchronous_standby_promoted_loses_nothing_and_keeps_one_owner(tmp_path):
    with servers(tmp_path) as own:
        primary = own.postgres("primary", synchronous_standby_names="*", synchronous_commit="on")
        standby = own.standby(primary, "standby", synchronous_standby_names="")
        wait_for(lambda: primary.sql("SELECT sync_state FROM pg_stat_replication") == "sync", timeout=20,
                 message="the standby never became synchronous")
        env = CrashEnv(tmp_path, both_hosts_url(primary, standby), own.redis().url())
        app = env.app()
        try:
            with celery_processes(tmp_path) as procs, reaper_loop(app, interval=1.0):
                procs.append(worker(APP, env.env(), tmp_path, pool="threads", concurrency=4, name="fo"))
                ids = env.publish(app, JOBS)
                # Given jobs under way on the primary
                wait_for(lambda: env.finished() >= 4 and len(env.running()) >= 3, timeout=60,
                         message="the worker never had jobs under way")
                running = env.running()
                # When the primary dies and the standby is promoted
                began = time.monotonic()
                primary.kill()
                while time.monotonic() < began + DETECTION:  # the outage's length is the test's input
                    time.sleep(0.05)
                standby.promote()
                failover = time.monotonic() - began
                # Then every job completes on the new primary
                wait_for(lambda: env.all_completed(ids), timeout=90, interval=0.25,
                         message="not every job completed after the failover")
                assert standby.sql("SELECT pg_is_in_recovery()") == "f"
        finally:
            env.close()
    runs = env.executions()
    assert running, "no body was under way at the kill"
    assert failover < LEASE / 2, f"the failover took {failover:.2f} s"
    # none finished twice (no completion was lost), each effect once, one owner at a time
    assert {job: sum(e.finished for e in runs[job]) for job in ids} == dict.fromkeys(ids, 1)
    assert_each_effect_once(env, ids)
    assert_one_owner_at_a_time(runs)
