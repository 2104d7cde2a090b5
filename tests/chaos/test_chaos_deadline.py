"""Chaos: one live owner, whatever the store says or does not say (Redis db 13, PostgreSQL).

One worker reaches PostgreSQL through a proxy the test freezes (connections stay open, no
byte passes: a black-hole partition) or is SIGSTOPped; the reaper (in the test process)
and a second worker reach PostgreSQL directly. Bodies report to Redis, with wall-clock
times, every check() that passed and the LeaseLost they got: the cut-off body's last
passing check must come before the second worker starts the job. Fast settings: 2 s
leases, 0.4 s heartbeats, 0.5 s grace (tests/apps/owner_app.py).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.helpers import wait_for
from tests.owner_env import APP, OwnerEnv
from tests.reaper_env import reaper_loop
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.chaos, pytest.mark.integration]


def second_start(oenv: OwnerEnv, job_id: str) -> float:
    """Wall time at which attempt 2 of the job started (waits for it)."""
    wait_for(lambda: len(oenv.started(job_id)) >= 2, timeout=30, message="the job was not taken over")
    [(_, _, at)] = [row for row in oenv.started(job_id) if row[0] == 2]
    return at


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_body_cut_off_from_the_store_stops_trusting_its_lease_before_another_worker_starts(oenv, tmp_path,
                                                                                            pool):
    app = oenv.app()
    proxy, through_proxy = oenv.proxied_store()
    with celery_processes(tmp_path) as procs:
        # Given a body checking its lease in a worker that reaches the store through the proxy
        procs.append(worker(APP, oenv.env(store_url=through_proxy), tmp_path, pool=pool, name="cutoff"))
        job = app.tasks["owner.guarded"].delay(60.0)
        wait_for(lambda: oenv.checked(job.id, 1), timeout=30, message="attempt 1 never checked its lease")
        # When the proxy black-holes its store connections (the heartbeat's statement hangs)
        frozen_at = time.time()
        proxy.freeze()
        procs.append(worker(APP, oenv.env(), tmp_path, pool=pool, name="rescuer"))
        with reaper_loop(app, interval=0.25):
            started_again = second_start(oenv, job.id)
            # Then the cut-off body got LeaseLost on its own clock, and its last passing
            # check came before the second worker started the job
            lost_at, reason = wait_for(lambda: oenv.lost(job.id, 1), timeout=10,
                                       message="the cut-off body never saw LeaseLost")
            last_pass = oenv.checked(job.id, 1)
            wait_for(lambda: oenv.store.get(job.id).status == "completed", timeout=20,
                     message="the second worker did not complete the job")
        oenv.release_held_slots()
    assert "local deadline passed" in reason
    assert frozen_at < last_pass < started_again, (frozen_at, last_pass, started_again)
    assert lost_at - frozen_at < 2.0  # within one lease of the cut: nothing waited on the store


def test_a_body_woken_after_its_lease_moved_on_refuses_at_once_without_the_store(oenv, tmp_path):
    app = oenv.app()
    proxy, through_proxy = oenv.proxied_store()
    with celery_processes(tmp_path) as procs:
        # Given a body checking its lease in a worker (its store behind the proxy)
        stopped = worker(APP, oenv.env(store_url=through_proxy), tmp_path, pool="threads", name="stopped")
        procs.append(stopped)
        job = app.tasks["owner.guarded"].delay(60.0)
        wait_for(lambda: oenv.checked(job.id, 1), timeout=30, message="attempt 1 never checked its lease")
        # When the worker is stopped past lease + grace and the job is taken over; any store
        # call the woken worker makes would hang (the proxy is frozen)
        stopped.signal(signal.SIGSTOP)
        stopped_at = time.time()
        proxy.freeze()
        procs.append(worker(APP, oenv.env(), tmp_path, pool="threads", name="rescuer"))
        with reaper_loop(app, interval=0.25):
            started_again = second_start(oenv, job.id)
            wait_for(lambda: oenv.store.get(job.id).status == "completed", timeout=20,
                     message="the second worker did not complete the job")
        last_pass = oenv.checked(job.id, 1)
        continued_at = time.time()
        stopped.signal(signal.SIGCONT)
        # Then its first check() raises, answered by nothing but its own clock
        lost_at, reason = wait_for(lambda: oenv.lost(job.id, 1), timeout=10,
                                   message="the woken body never saw LeaseLost")
        oenv.release_held_slots()
    assert "local deadline passed" in reason
    assert last_pass < stopped_at < started_again < continued_at <= lost_at
    assert oenv.checked(job.id, 1) == last_pass  # no check passed after the wake-up
    assert lost_at - continued_at < 2.0


def test_a_threads_body_past_its_max_runtime_is_interrupted_before_the_takeover_and_its_lock_freed(
        oenv, tmp_path):
    app = oenv.app()
    with celery_processes(tmp_path) as procs:
        # Given a threads-pool body holding a resource lock and outliving lease_max_runtime (1 s)
        procs.append(worker(APP, oenv.env(), tmp_path, pool="threads", concurrency=2))
        job = app.tasks["owner.overrun"].delay()
        wait_for(lambda: oenv.started(job.id), timeout=30, message="attempt 1 never started")
        with reaper_loop(app, interval=0.25):
            # Then LeaseLost lands in it, the lock is free, and only later the reaper takes the job
            lost_at, reason = wait_for(lambda: oenv.lost(job.id, 1), timeout=10,
                                       message="the overrun body was not interrupted")
            wait_for(lambda: oenv.store.reports.lock_holder(f"res:{job.id}") is None, timeout=5,
                     message="the overrun body's lock was not freed")
            second = second_start(oenv, job.id)
            wait_for(lambda: oenv.store.get(job.id).status == "completed", timeout=20,
                     message="the job was not completed by its next attempt")
    [taken] = oenv.store.reports.events(job.id, "reaped_expired_lease")
    assert "lease_max_runtime" in reason
    assert lost_at < taken["at"] < second
