"""A group's LeaseTask jobs are recorded a batch at a time, before any of its messages is sent.

Real Redis broker (db 6, a key prefix per test) and each store kind; the statements are counted
with a SQLAlchemy event hook on the app's store engine, the messages read from the broker.
"""

from __future__ import annotations

import sqlite3

import kombu
import pytest
import sqlalchemy as sa
from celery import Celery, chord, group

from celery_lease import LeaseTask
from celery_lease.errors import StoreUnavailable
from celery_lease.messaging import messages
from celery_lease.publish import batching
from celery_lease.store import COMPLETED, PENDING, for_app, publishes
from tests.conftest import drop_app_store, migrated_store, prefixed_redis, unique_prefix
from tests.helpers import wait_for

REDIS_DB = 6


@pytest.fixture
def app(redis_url, store_url, monkeypatch):
    monkeypatch.setattr(publishes, "RECORD_BATCH", 10)
    # A 30 s lease bounds each store call at seconds, not a fraction of one: these tests count
    # statements, and a server stall must not fail them (no lease here expires).
    # A loaded machine could take longer than BATCH_WAIT to build a group: the tests that count
    # statements keep the whole loop in one batch (the generator's test sets it back).
    monkeypatch.setattr(batching, "BATCH_WAIT", 60.0)
    with prefixed_redis(redis_url, REDIS_DB) as (url, client, keyprefix):
        options = {"global_keyprefix": keyprefix}
        app = Celery(f"batch_{unique_prefix()}", broker=url, backend=url, set_as_current=False)
        app.conf.update(lease_store_url=store_url, lease_table_prefix=unique_prefix(), lease_duration=30.0,
                        lease_heartbeat_interval=10.0, broker_transport_options=options,
                        result_backend_transport_options=options, task_default_queue="batch")

        @app.task(base=LeaseTask, shared=False, name="batch.work")
        def work(n):
            return n

        @app.task(shared=False, name="batch.total")
        def total(values):
            return sum(values)

        migrated_store(app)
        app.queued = lambda: client.llen(f"{keyprefix}batch")  # messages waiting in the queue now
        yield app
        drop_app_store(app)


@pytest.fixture
def inserts(app):
    """The INSERT statements the app's store runs, as the name of the table each one writes."""
    store = for_app(app, check=False)
    seen: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        words = statement.split()
        if words[:2] == ["INSERT", "INTO"]:
            seen.append(words[2].strip('`"').removeprefix(store.prefix))

    sa.event.listen(store.engine, "before_cursor_execute", count)
    yield seen
    sa.event.remove(store.engine, "before_cursor_execute", count)


def store_kind(app: Celery) -> str:
    return sa.engine.make_url(app.conf.lease_store_url).get_backend_name()


def queued_ids(app: Celery, expected: int) -> list[str]:
    """The task ids of the messages waiting in the app's queue, in the order a consumer gets them."""
    with kombu.Connection(app.conf.broker_url, transport_options=app.conf.broker_transport_options) as conn:
        q = conn.SimpleQueue("batch", no_ack=True)
        found = []
        while True:
            try:
                # Up to 5 s for each expected message; past those, a short look for an extra one.
                found.append(q.get(timeout=5 if len(found) < expected else 0.2).headers["id"])
            except q.Empty:
                return found


def test_a_group_records_its_jobs_with_one_insert_per_table_per_batch_and_sends_them_in_order(app, inserts):
    work = app.tasks["batch.work"]
    result = group([work.s(i) for i in range(25)]).apply_async()
    ids = [r.id for r in result.results]
    # 25 jobs in batches of 10: three INSERTs into the jobs table and three into the events table.
    assert inserts == ["jobs", "events"] * 3
    assert queued_ids(app, 25) == ids
    store = for_app(app)
    for job_id in ids:
        assert store.get(job_id).status == PENDING
        assert [e["event"] for e in store.reports.events(job_id)] == ["published"]
    # The stored message is the one sent: it reads back as the job's own signature.
    signature = messages.decode(store.get(ids[7]).payload)
    assert (signature["task"], list(signature["args"])) == ("batch.work", [7])


def test_a_chord_header_is_recorded_as_one_batch_and_its_body_waits(app, inserts):
    work, total = app.tasks["batch.work"], app.tasks["batch.total"]
    result = chord([work.s(i) for i in range(5)])(total.s())
    header_ids = [r.id for r in result.parent.results]
    assert inserts == ["jobs", "events"]
    assert queued_ids(app, 5) == header_ids
    assert for_app(app).get(result.id) is None  # the body is sent when the header completes


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # the batch's timer, on any store
@pytest.mark.parametrize("task_name", ["batch.total", "batch.work"], ids=["plain", "leased"])
def test_a_generator_that_waits_for_the_first_task_sent_gets_it_while_it_still_yields(app, task_name,
                                                                                      monkeypatch):
    monkeypatch.setattr(batching, "BATCH_WAIT", 0.05)
    task = app.tasks[task_name]

    def signatures():
        # Celery's promise for a chord header's generator (celery#3021): the tasks applied
        # before are sent while the generator still runs, so it may wait for them.
        for i in range(6):
            if i == 5:
                wait_for(lambda: app.queued() >= 1, timeout=5, message="the first message is sent")
            yield task.s(i)

    result = group(signatures()).apply_async()
    assert queued_ids(app, 6) == [r.id for r in result.results]


def test_a_keyed_task_in_a_group_sends_the_jobs_kept_before_it_first(app, inserts):
    work = app.tasks["batch.work"]
    signatures = [work.s(0), work.s(1), work.s(2).set(idempotency_key="k-2"), work.s(3)]
    result = group(signatures).apply_async()
    ids = [r.id for r in result.results]
    assert queued_ids(app, 4) == ids
    # Two kept jobs as one batch, the keyed job by itself (on PostgreSQL and SQLite on the
    # driver connection, which the hook does not see), then the last one as a batch of one.
    assert inserts[0:2] == ["jobs", "events"] and inserts[-2:] == ["jobs", "events"]
    assert inserts.count("jobs") == (2 if store_kind(app) in ("postgresql", "sqlite") else 3)
    assert for_app(app).get(ids[2]).idempotency_key == "k-2"


def test_a_group_applied_again_reopens_its_finished_jobs_one_by_one(app, inserts):
    work = app.tasks["batch.work"]
    signature = group([work.s(i) for i in range(3)])
    signature.freeze()
    first = signature.apply_async()
    ids = [r.id for r in first.results]
    store = for_app(app)
    t = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(t).where(t.c.id == ids[1]).values(status=str(COMPLETED)))
    again = signature.apply_async()
    assert [r.id for r in again.results] == ids
    assert store.get(ids[1]).status == PENDING
    assert [e["event"] for e in store.reports.events(ids[1])] == ["published", "republished"]
    assert queued_ids(app, 6) == ids + ids


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_group_whose_store_cannot_record_it_raises_and_sends_none_of_its_messages(app):
    work = app.tasks["batch.work"]
    path = sa.engine.make_url(app.conf.lease_store_url).database
    holder = sqlite3.connect(path, timeout=0)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the file past the store's bound
    try:
        with pytest.raises(StoreUnavailable):
            group([work.s(i) for i in range(4)]).apply_async()
    finally:
        holder.rollback()
        holder.close()
    assert queued_ids(app, 0) == []
    assert for_app(app).reports.list_jobs() == []
