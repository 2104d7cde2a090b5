"""The report queries the web page adds (store/reports.py), on every store kind.

overview_counts, list_workers, and list_jobs' owner and time-window filters; the rest of the
reports are covered through the CLI (test_cli.py) and the exporter (test_metrics.py).
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa

from celery_lease.store import ClaimTerms

TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=3, max_expirations=3, takeover=False)


def claimed(store, job_id: str, queue: str = "q", owner: str = "w1") -> str:
    store.publishes.record(job_id, "t.task", queue, None, 3)
    token = secrets.token_hex(16)
    assert store.jobs.claim(job_id, owner, token, TERMS, task_name="t.task", queue=queue,
                            payload=lambda: None).claimed
    return token


def age_rows(store, job_ids: list[str], seconds: float) -> None:
    """Move the rows' last change ``seconds`` into the past."""
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id.in_(job_ids)).values(updated_at=j.c.updated_at - seconds))


def test_overview_counts_every_job_in_flight_and_only_the_recent_completions(store):
    store.publishes.record("p1", "t.task", "a", None, 3)
    claimed(store, "r1", "b")
    store.jobs.fail("f1", claimed(store, "f1", "a"), "boom")
    for job_id in ("c-new", "c-old"):
        store.jobs.complete(job_id, claimed(store, job_id, "a"))
    age_rows(store, ["c-old", "f1", "p1"], 7200)

    now, counts = store.reports.overview_counts(3600)

    assert abs(now - store.now()) < 5
    assert counts == [("a", "completed", 1), ("a", "failed", 1), ("a", "pending", 1), ("b", "running", 1)]


def test_list_workers_puts_the_most_recently_seen_first_and_says_which_are_alive(store):
    store.stale_after = 10.0
    store.workers.touch_worker("gone", "h", 1)
    store.workers.touch_worker("here", "h", 2)
    w = store.t.workers
    with store.begin() as c:
        c.execute(sa.update(w).where(w.c.worker_id == "gone").values(last_seen_at=w.c.last_seen_at - 60))

    _, workers = store.reports.list_workers()

    assert [(x["worker_id"], x["alive"], x["pid"]) for x in workers] == [
        ("here", True, 2), ("gone", False, 1)]


def test_list_jobs_filters_by_owner_and_by_when_the_job_last_changed(store):
    claimed(store, "mine", owner="w1")
    claimed(store, "theirs", owner="w2")
    claimed(store, "mine-old", owner="w1")
    age_rows(store, ["mine-old"], 7200)

    assert sorted(j.id for j in store.reports.list_jobs(owner="w1")) == ["mine", "mine-old"]
    assert [j.id for j in store.reports.list_jobs(owner="w1", since=3600)] == ["mine"]
    assert sorted(j.id for j in store.reports.list_jobs(since=3600)) == ["mine", "theirs"]

