"""The app the operations tests run `celery -A tests.apps.ops_app lease ...` against.

Configured from the environment, read when ``app`` is looked up (not at import), so
each test can point the CLI at its own store: OPS_STORE (SQLAlchemy URL), OPS_PREFIX
(table prefix) and OPS_BROKER (default Redis db 10). One app is built per
configuration. ``populate()`` fills a store with a known scene for the CLI, metrics
and exporter tests.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import sqlalchemy as sa
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.messaging import messages
from celery_lease.store import ClaimTerms

BROKER = "redis://127.0.0.1:6379/10"
SETTINGS = dict(
    lease_duration=2.0, lease_heartbeat_interval=0.5, lease_grace_period=0.5,
    lease_worker_stale_after=300.0, lease_reaper_hard_grace=600.0, lease_max_attempts=3,
    lease_backoff_base=0.0, lease_backoff_max=0.0,
)
ALIVE, DEAD = "alive@ops:1", "dead@ops:2"

_apps: dict[tuple[str, str, str], Celery] = {}
_lock = threading.Lock()


def build(store_url: str, prefix: str, broker: str = BROKER) -> Celery:
    """A Celery app with three LeaseTasks over the given store and broker."""
    app = Celery("ops_app", broker=broker, set_as_current=False)
    app.conf.update(lease_store_url=store_url, lease_table_prefix=prefix, task_ignore_result=True,
                    **SETTINGS)

    @app.task(base=LeaseTask, name="ops.quick", shared=False)
    def quick(n: int = 0) -> int:
        return n

    @app.task(base=LeaseTask, name="ops.slow", shared=False, lease_duration=60.0,
              lease_heartbeat_interval=5.0)
    def slow(n: int = 0) -> int:
        return n

    @app.task(base=LeaseTask, name="ops.fails", shared=False)
    def fails() -> None:
        raise ValueError("boom")

    return app


def __getattr__(name: str) -> Any:
    if name != "app":
        raise AttributeError(name)
    key = (os.environ.get("OPS_STORE", "sqlite:///ops.sqlite3"), os.environ.get("OPS_PREFIX", "ops_"),
           os.environ.get("OPS_BROKER", BROKER))
    with _lock:
        if key not in _apps:
            _apps[key] = build(*key)
        return _apps[key]


# -- the scene ----------------------------------------------------------------------
def _payload(task: str, n: int, queue: str = "celery") -> str:
    options = {"queue": queue} if queue != "celery" else {}
    return messages.encode(task, () if task == "ops.fails" else (n,), {}, options, "json")


def _set(store: Any, job_id: str, **values: Any) -> None:
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(**values))


def _claim(store: Any, job_id: str, task: str, queue: str, owner: str) -> str:
    token = secrets.token_hex(16)
    claim = store.jobs.claim(job_id, owner, token,
                             ClaimTerms(duration=2.0, grace=0.5,
                                        max_attempts=3, max_expirations=3, takeover=False),
                             task_name=task, queue=queue, payload=lambda: None)
    assert claim.claimed, claim
    return token


def _running(store: Any, job_id: str, task: str, queue: str, owner: str, **times: float) -> None:
    store.publishes.record(job_id, task, queue, _payload(task, 0, queue), 3)
    _claim(store, job_id, task, queue, owner)
    _set(store, job_id, **times)
    # Published a moment before the claim the row now dates (the claim writes no event of its own).
    e = store.t.events
    with store.begin() as c:
        c.execute(sa.update(e).where(e.c.job_id == job_id, e.c.event == "published")
                  .values(at=times["started_at"] - 1.0))


def taken_over_twice(store: Any, job_id: str) -> list[tuple[str, str, float]]:
    """Record ``job_id`` and run it three times: claimed by ``w1``, its lease abandoned and taken
    over by ``w2``, then by ``w3``, which completes it. Each attempt as (worker, token, started_at)."""
    terms = ClaimTerms(duration=30.0, grace=0.0, max_attempts=5, max_expirations=5, takeover=True)
    store.publishes.record(job_id, "ops.quick", "celery", _payload("ops.quick", 0), 5)
    attempts = []
    for worker in ("w1", "w2", "w3"):
        if attempts:  # the last owner (never registered: gone) let its lease expire
            _set(store, job_id, lease_expires_at=store.now_sql - 10.0)
        token = secrets.token_hex(16)
        claim = store.jobs.claim(job_id, worker, token, terms, task_name="ops.quick", queue="celery",
                                 payload=lambda: None)
        assert claim.claimed, claim
        attempts.append((worker, token, claim.job.started_at))
    assert store.jobs.complete(job_id, attempts[-1][1], "w3")
    return attempts


def heartbeat(store: Any, job_ids: list[str]) -> None:
    """Stamp a fresh heartbeat on running jobs (as their worker's heartbeat would), lease untouched."""
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id.in_(job_ids)).values(last_heartbeat_at=store.now_sql))


def populate(store: Any) -> dict[str, list[str]]:
    """Fill a migrated store with a known scene; returns job ids by kind.

    - pending: 3 ``ops.quick`` on ``celery``; 1 ``ops.slow`` on ``reports`` due 100 s ago
    - live: 2 ``ops.slow`` on ``reports`` running under ALIVE, lease valid for 600 s
    - abandoned: 3 running under DEAD (unseen for an hour), leases expired 100-102 s ago
    - alive_expired: 1 running under ALIVE, lease expired 5 s ago (inside the 600 s hard grace)
    - completed: 40 ``ops.quick`` (0.1 .. 4.0 s) and 20 ``ops.slow`` (10 .. 29 s, every 5th on attempt 2)
    - failed: 2 ``ops.fails``, 1 revoked ``ops.quick``
    - events: 2 reaped_expired_lease, 1 duplicate_delivery_skipped, 1 stale_completion_rejected
    """
    scene: dict[str, list[str]] = {k: [] for k in
                                   ("pending", "live", "abandoned", "alive_expired", "completed", "failed",
                                    "revoked")}
    store.workers.touch_worker(ALIVE, "ops", 1)
    store.workers.touch_worker(DEAD, "ops", 2)
    now = store.now()
    w = store.t.workers
    with store.begin() as c:
        c.execute(sa.update(w).where(w.c.worker_id == DEAD).values(last_seen_at=now - 3600))
    for i in range(3):
        job_id = f"pending-{i}"
        store.publishes.record(job_id, "ops.quick", "celery", _payload("ops.quick", i), 3)
        scene["pending"].append(job_id)
    store.publishes.record("pending-late", "ops.slow", "reports", _payload("ops.slow", 0, "reports"), 3)
    _set(store, "pending-late", available_at=now - 100)
    scene["pending"].append("pending-late")
    for i in range(2):
        _running(store, f"live-{i}", "ops.slow", "reports", ALIVE, lease_expires_at=now + 600,
                 started_at=now - 30, last_heartbeat_at=now - 0.5)
        scene["live"].append(f"live-{i}")
    for i in range(3):
        _running(store, f"abandoned-{i}", "ops.quick", "celery", DEAD, lease_expires_at=now - 100 - i,
                 started_at=now - 200, last_heartbeat_at=now - 102 - i)
        scene["abandoned"].append(f"abandoned-{i}")
    _running(store, "alive-expired", "ops.quick", "celery", ALIVE, lease_expires_at=now - 5,
             started_at=now - 10, last_heartbeat_at=now - 7)
    scene["alive_expired"].append("alive-expired")
    shapes = (("ops.quick", 40, lambda i: 0.1 * (i + 1)), ("ops.slow", 20, lambda i: 10.0 + i))
    for task, count, runtime in shapes:
        for i in range(count):
            job_id = f"done-{task}-{i}"
            store.publishes.record(job_id, task, "celery", _payload(task, i), 3)
            store.jobs.complete(job_id, _claim(store, job_id, task, "celery", ALIVE), ALIVE)
            done = store.t.jobs.c.completed_at  # as the completion wrote it, read by the UPDATE itself
            _set(store, job_id, started_at=done - runtime(i), last_heartbeat_at=done - min(runtime(i), 0.4),
                 attempt_count=2 if task == "ops.slow" and i % 5 == 0 else 1)
            scene["completed"].append(job_id)
    for i in range(2):
        job_id = f"failed-{i}"
        store.publishes.record(job_id, "ops.fails", "celery", _payload("ops.fails", i), 3,
                               idempotency_key=f"fails-{i}")
        store.jobs.fail(job_id, _claim(store, job_id, "ops.fails", "celery", ALIVE), "ValueError: boom",
                        ALIVE)
        scene["failed"].append(job_id)
    store.publishes.record("revoked-0", "ops.quick", "celery", _payload("ops.quick", 0), 3)
    store.jobs.cancel("revoked-0", "revoked")
    scene["revoked"].append("revoked-0")
    for job_id in scene["abandoned"][:2]:
        store.event(job_id, "reaped_expired_lease", "lease expired", DEAD, "0123456789")
    store.event("done-ops.quick-0", "duplicate_delivery_skipped", "job completed", ALIVE)
    store.event("done-ops.quick-1", "stale_completion_rejected", "lock token no longer matches", DEAD,
                "abcdef12")
    return scene
