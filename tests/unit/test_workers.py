"""The worker registry in store/workers.py, and the heartbeat round that refreshes it."""

from __future__ import annotations

import secrets

import sqlalchemy as sa

from celery_lease.store import ClaimTerms


def workers(store) -> list:
    with store.begin() as c:
        return c.execute(sa.select(store.t.workers)).all()


def backdate(store, worker_id: str, seconds: float) -> float:
    """Move a worker's last_seen_at into the past (test-only SQL); returns the new value."""
    w = store.t.workers
    with store.begin() as c:
        c.execute(sa.update(w).where(w.c.worker_id == worker_id).values(last_seen_at=store.now_sql - seconds))
        return c.execute(sa.select(w.c.last_seen_at).where(w.c.worker_id == worker_id)).scalar_one()


def test_touch_worker_registers_then_refreshes(store):
    store.workers.touch_worker("w1", "host", 42)
    first = backdate(store, "w1", 60)
    store.workers.touch_worker("w1", "host", 42)
    rows = workers(store)
    assert len(rows) == 1 and rows[0].pid == 42 and rows[0].last_seen_at > first


def test_a_beat_without_leases_still_registers_the_process(store):
    assert store.jobs.beat("w1", "host", 7, {}) == set()
    rows = workers(store)
    assert [(r.worker_id, r.hostname, r.pid) for r in rows] == [("w1", "host", 7)]


def test_a_beat_refreshes_the_registry_and_renews_only_matching_tokens(store):
    store.workers.touch_worker("w1", "host", 7)
    seen = backdate(store, "w1", 60)
    tokens = {}
    for job_id in ("a", "b"):
        store.publishes.record(job_id, "t.task", "q", None, 3)
        tokens[job_id] = secrets.token_hex(16)
        assert store.jobs.claim(job_id, "w1", tokens[job_id],
                                ClaimTerms(duration=30.0, grace=1.0,
                                           max_attempts=3, max_expirations=3, takeover=False),
                                task_name="t.task", queue="q", payload=lambda: None).claimed
    expiry = store.get("a").lease_expires_at
    renewed = store.jobs.beat("w1", "host", 7, {tokens["a"]: "a", "stale-token": "b"}, {tokens["a"]: 120.0})
    assert renewed == {"a"}
    assert workers(store)[0].last_seen_at > seen
    job = store.get("a")
    assert job.lease_duration == 120.0 and job.lease_expires_at > expiry + 60


def test_a_worker_process_records_its_pool_and_concurrency(store):
    store.ensure_schema()
    store.workers.worker_pool = ("threads", 8)

    store.workers.touch_worker("w1", "host", 42)

    (row,) = workers(store)
    assert (row.pool, row.concurrency) == ("threads", 8)
    assert store.reports.worker_pools() == {"threads": 1}


def test_pool_names_are_celerys_own():
    from celery.concurrency import get_implementation

    from celery_lease.integration.signals import pool_name

    class Worker:
        def __init__(self, pool_cls):
            self.pool_cls = pool_cls

    assert pool_name(Worker(get_implementation("threads"))) == "threads"
    assert pool_name(Worker(get_implementation("prefork"))) == "prefork"
    assert pool_name(Worker(get_implementation("solo"))) == "solo"
    assert pool_name(Worker("gevent")) == "gevent"
    assert pool_name(Worker("celery.concurrency.thread:TaskPool")) == "threads"
