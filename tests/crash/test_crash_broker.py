"""The Redis broker SIGKILLed mid-run and restarted empty (no persistence: every message is gone).

A private redis-server (``--save "" --appendonly no``) and a private PostgreSQL store; one
prefork worker (-c 2) runs 32 jobs of three steps (tests/apps/crash_app.py), the reaper runs
every second in the test process with a 2 s ``lease_dispatch_timeout`` (the app's). The queued jobs'
messages die with the broker, the running jobs' acknowledgements cannot be sent: the reaper's
dispatch scan re-sends every pending job, and each job still runs its body once.
"""

from __future__ import annotations

import pytest

from tests.crash.crash_env import APP, CrashEnv, assert_each_effect_once
from tests.helpers import wait_for
from tests.reaper_env import reaper_loop
from tests.servers import servers
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.slow]

JOBS = 32


def test_a_broker_killed_and_restarted_empty_still_completes_every_job_once(tmp_path):
    with servers(tmp_path) as own:
        pg, broker = own.postgres(), own.redis()
        env = CrashEnv(tmp_path, pg.url(), broker.url())
        app = env.app()
        try:
            with celery_processes(tmp_path) as procs, reaper_loop(app, interval=1.0):
                procs.append(worker(APP, env.env(), tmp_path, pool="prefork", concurrency=2, name="brokerw"))
                ids = env.publish(app, JOBS)
                # Given jobs under way and most still queued in the broker
                wait_for(lambda: env.finished() >= 4 and len(env.running()) >= 2, timeout=60,
                         message="the worker never had jobs under way")
                running, finished_before = env.running(), env.finished()
                # When the broker dies and comes back empty
                broker.client().set("crash:before-the-kill", 1)
                broker.kill()
                broker.start()
                kept = broker.client().exists("crash:before-the-kill")
                # Then the dispatch scan re-sends what was lost, and every job completes
                wait_for(lambda: env.all_completed(ids), timeout=90, interval=0.25,
                         message="not every job completed after the broker lost its messages")
                redispatched = env.store.reports.events(event="redispatched")
        finally:
            env.close()
    runs = env.executions()
    assert kept == 0, "the restarted broker kept what it held"
    assert running and finished_before < JOBS - len(running), "the kill did not land mid-run"
    assert redispatched, "nothing was re-sent, so no message was lost"
    # each job ran its body once and finished once; each effect once
    assert {job: len(runs[job]) for job in ids} == dict.fromkeys(ids, 1)
    assert {job: sum(e.finished for e in runs[job]) for job in ids} == dict.fromkeys(ids, 1)
    assert_each_effect_once(env, ids)
