"""LeaseTask in a real prefork ``celery worker`` subprocess (Redis broker, PostgreSQL store)."""

from __future__ import annotations

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from celery_lease.store import Store
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.workers import celery_processes, worker

pytestmark = pytest.mark.integration

BROKER_DB = 6


@pytest.fixture
def env(redis_url, postgres_url):
    broker = redis_url.rsplit("/", 1)[0] + f"/{BROKER_DB}"
    client = redis.Redis.from_url(broker)
    client.flushdb()
    prefix = unique_prefix()
    store = Store(postgres_url, prefix)
    store.migrate()
    yield {"CORE_BROKER": broker, "CORE_STORE": postgres_url, "CORE_PREFIX": prefix}, store, client
    store.t.metadata.drop_all(store.engine)
    store.engine.dispose()
    client.flushdb()
    client.close()


def client_app(env_vars) -> Celery:
    app = Celery("core_client", broker=env_vars["CORE_BROKER"], backend=env_vars["CORE_BROKER"],
                 set_as_current=False)
    app.conf.update(lease_store_url=env_vars["CORE_STORE"], lease_table_prefix=env_vars["CORE_PREFIX"])
    return app


def test_prefork_child_holds_the_lease_and_duplicates_are_skipped(env, tmp_path):
    env_vars, store, client = env
    app = client_app(env_vars)
    with celery_processes(tmp_path) as procs:
        procs.append(worker("tests.apps.core_app", env_vars, tmp_path, pool="prefork", concurrency=2))
        first = app.send_task("core.work", (0.5,))
        app.send_task("core.work", (0.5,), task_id=first.id)  # the same job, delivered twice
        result = first.get(timeout=30)
        wait_for(lambda: [e for e in store.reports.events(first.id)
                          if e["event"] == "duplicate_delivery_skipped"],
                 timeout=15, message="second delivery was not skipped")
    job = store.get(first.id)
    # The row was created by the worker (published by name, without celery_lease).
    assert job.status == "completed" and job.attempt_count == 1
    assert job.locked_by == result["worker"] and job.locked_by.endswith(f":{result['pid']}")
    assert int(client.get(f"runs:{first.id}")) == 1
    # The worker's claim created the row (first seen: audited); the completion is the row's.
    assert sorted(e["event"] for e in store.reports.events(first.id)) == [
        "claimed", "duplicate_delivery_skipped"]
    assert job.completed_at is not None and job.completed_at >= job.started_at


def test_a_worker_with_an_invalid_lease_setting_refuses_to_start(env, tmp_path):
    env_vars, _, _ = env
    bad = {**env_vars, "CORE_CONF": '{"lease_duration": 1.5, "lease_heartbeat_interval": 1.0}'}
    with celery_processes(tmp_path) as procs:
        proc = worker("tests.apps.core_app", bad, tmp_path, pool="solo")
        procs.append(proc)
        code = proc.popen.wait(60)
    assert code != 0
    rule = "lease_heartbeat_interval=1.0 is invalid: must be at most a third of lease_duration"
    assert rule in proc.output()


def test_a_soft_time_limit_fails_the_job_as_celery_does(env, tmp_path):
    env_vars, store, client = env
    app = client_app(env_vars)
    with celery_processes(tmp_path) as procs:
        procs.append(worker("tests.apps.core_app", env_vars, tmp_path, pool="prefork"))
        result = app.send_task("core.limited")
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=30)
    job = store.get(result.id)
    assert job.status == "failed" and job.last_error.startswith("SoftTimeLimitExceeded")
    assert int(client.get(f"runs:{result.id}")) == 1


def test_revoke_with_terminate_cancels_the_running_job_and_never_requeues_it(env, tmp_path):
    env_vars, store, client = env
    app = client_app(env_vars)
    with celery_processes(tmp_path) as procs:
        procs.append(worker("tests.apps.core_app", env_vars, tmp_path, pool="prefork"))
        result = app.send_task("core.work", (30,))
        wait_for(lambda: (store.get(result.id) or None) and store.get(result.id).status == "running",
                 timeout=30, message="job never claimed")
        app.control.revoke(result.id, terminate=True)
        wait_for(lambda: store.get(result.id).status == "failed", timeout=15,
                 message=f"job not cancelled: {store.reports.events(result.id)}")
        wait_for(lambda: result.state == "REVOKED", timeout=15, message="Celery did not mark it revoked")
        # A fresh job runs on the replacement child: the worker went on, and the revoked job with it.
        after = app.send_task("core.work", (0.0,))
        after.get(timeout=30)
    job = store.get(result.id)
    assert job.last_error == "revoked (terminated)" and job.attempt_count == 1
    assert int(client.get(f"runs:{result.id}")) == 1
    assert [e["event"] for e in store.reports.events(result.id)].count("claimed") == 1


def test_revoke_with_the_soft_signal_lets_a_body_that_cleans_up_end_as_celery_ends_it(env, tmp_path):
    """``revoke(terminate=True, signal="SIGUSR1")`` raises SoftTimeLimitExceeded in the body; one that
    catches it and returns succeeds, as in Celery, and is never run again."""
    env_vars, store, client = env
    app = client_app(env_vars)
    with celery_processes(tmp_path) as procs:
        procs.append(worker("tests.apps.core_app", env_vars, tmp_path, pool="prefork"))
        result = app.send_task("core.cleans_up")
        # Inside the body: a signal landing in the claim is not what this test is about.
        wait_for(lambda: client.get(f"runs:{result.id}") is not None, timeout=30, message="body never ran")
        app.control.revoke(result.id, terminate=True, signal="SIGUSR1")
        wait_for(lambda: store.get(result.id).status != "running", timeout=15,
                 message=f"job never ended: {store.reports.events(result.id)}")
        app.send_task("core.work", (0.0,)).get(timeout=30)  # after anything requeued would have run
    # The body's return completed the job. Celery's state is its own race, as without a lease: the
    # worker's REVOKED and the body's SUCCESS are stored in whichever order they come.
    assert store.get(result.id).status == "completed", store.reports.events(result.id)
    assert result.state in ("SUCCESS", "REVOKED")
    assert int(client.get(f"runs:{result.id}")) == 1


@pytest.mark.parametrize("call", ["claim:checkin", "complete:checkout"])
def test_a_soft_time_limit_landing_in_the_claim_or_the_completion_leaves_no_job_running(env, tmp_path, call):
    """The soft time limit (billiard's SIGUSR1, as a soft_time_limit or a SIGUSR1 revoke sends it) arriving in
    a store call outside the body: after the claim committed it lands as the body starts (FAILURE, as in a
    plain task's body); before a finished body's completion it waits for the write (SUCCESS). Either way the
    job ends in the store and is never run again."""
    env_vars, store, client = env
    env_vars = {**env_vars, "CORE_CONF": '{"lease_fault_injector": "tests.apps.soft_signal:INJECTOR"}'}
    app = client_app(env_vars)
    job_id = f"soft-{unique_prefix()}"
    client.set(f"soft_signal:{job_id}", call)
    with celery_processes(tmp_path) as procs:
        procs.append(worker("tests.apps.core_app", env_vars, tmp_path, pool="prefork"))
        # The child's first delivery checks the schema, a connection of its own: the job's calls come after.
        app.send_task("core.work", (0.0,)).get(timeout=30)
        # Recorded as published: its claim is one write, the one the signal follows or precedes.
        store.publishes.record(job_id, "core.work", "celery", None, max_attempts=3)
        result = app.send_task("core.work", (0.0,), task_id=job_id)
        wait_for(lambda: result.state in ("SUCCESS", "FAILURE"), timeout=30, message="the run never ended")
        assert client.get(f"soft_signal:fired:{job_id}") is not None, "the signal was never sent"
        wait_for(lambda: store.get(job_id).status != "running", timeout=15,
                 message=f"job left running: {store.reports.events(job_id)}")
        app.send_task("core.work", (0.0,)).get(timeout=30)  # after anything requeued would have run
    job = store.get(job_id)
    if call.startswith("claim"):
        assert isinstance(result.result, SoftTimeLimitExceeded), result.result
        assert job.status == "failed" and client.get(f"runs:{job_id}") is None
    else:
        assert result.state == "SUCCESS" and job.status == "completed"
        assert int(client.get(f"runs:{job_id}")) == 1
