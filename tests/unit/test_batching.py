"""A group's LeaseTask jobs are recorded a batch at a time, before any of its messages is sent.

Real Redis broker (db 6, a key prefix per test) and each store kind; the statements are counted
with a SQLAlchemy event hook on the app's store engine, the messages read from the broker. Where
the wrapper is installed (when a LeaseTask is bound, never at import) runs in fresh interpreters.
"""

from __future__ import annotations

import inspect
import logging
import sqlite3
import subprocess
import sys
from pathlib import Path

import celery
import kombu
import pytest
import sqlalchemy as sa
from celery import Celery, chain, chord, group, signals
from celery._state import pop_current_task, push_current_task

from celery_lease import LeaseTask
from celery_lease.errors import StoreUnavailable
from celery_lease.messaging import messages
from celery_lease.publish import batching
from celery_lease.store import COMPLETED, PENDING, for_app, publishes
from tests.conftest import drop_app_store, migrated_store, prefixed_redis, unique_prefix
from tests.helpers import wait_for

REDIS_DB = 6
ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture
def batched_publishes(app):
    """The name of each task the app publishes, and whether a group's batch was open for it."""
    seen: list[tuple[str, bool]] = []

    def note(sender=None, **_):
        seen.append((sender, batching.current() is not None))

    signals.before_task_publish.connect(note, weak=False)
    yield seen
    signals.before_task_publish.disconnect(note)


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


def test_a_group_given_a_producer_sends_every_job_through_it_as_celery_does(app, redis_url):
    with prefixed_redis(redis_url, REDIS_DB + 1) as (url, client, keyprefix), kombu.Connection(
            url, transport_options={"global_keyprefix": keyprefix}) as other:
        result = group([app.tasks["batch.work"].s(i) for i in range(3)]).apply_async(
            producer=app.amqp.Producer(other))
        assert app.queued() == 0
        assert client.llen(f"{keyprefix}batch") == 3
        assert all(for_app(app).get(r.id).status == PENDING for r in result.results)


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


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_group_sent_after_a_body_while_the_store_cannot_record_it_is_sent_whole(app):
    # Celery's post-run work (a chain's next step that is a group) or a plain task's body: plain Celery
    # would send the group, so each job goes out unrecorded and its claim records it.
    work, plain = app.tasks["batch.work"], app.tasks["batch.total"]
    path = sa.engine.make_url(app.conf.lease_store_url).database
    holder = sqlite3.connect(path, timeout=0)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the file past the store's bound
    plain.push_request(id="the-plain-task", called_directly=False)
    push_current_task(plain)
    try:
        result = group([work.s(i) for i in range(2)]).apply_async()
    finally:
        pop_current_task()
        plain.pop_request()
        holder.rollback()
        holder.close()
    assert queued_ids(app, 2) == [r.id for r in result.results]
    assert for_app(app).reports.list_jobs() == []


def test_a_group_a_body_published_whose_record_landed_unanswered_is_deleted_when_the_outage_ends_it(app):
    # The body's outage gives it back and its next run publishes the group anew: the first group, whose
    # batch committed while its answer was lost and whose messages were never sent, must not also run (the
    # dispatch scan would send it ten minutes later), as a single publish's job does not.
    from celery.app.trace import build_tracer

    work, store = app.tasks["batch.work"], for_app(app)

    @app.task(base=LeaseTask, bind=True, shared=False, name="batch.parent", acks_late=True)
    def parent(self):
        group(work.s(i) for i in range(3)).apply_async()

    parent_id = parent.apply_async().id
    real, lost = store.publishes.record_batch, []

    def answer_lost(jobs):
        real(jobs)
        lost.append([job.id for job in jobs])
        raise StoreUnavailable("connection dropped before the answer")

    store.publishes.record_batch = answer_lost
    tracer = build_tracer(parent.name, parent, app=app, eager=False, propagate=False)
    request = {"id": parent_id, "task": parent.name, "hostname": "batch@test", "headers": {},
               "is_eager": False,
               "delivery_info": {"routing_key": "batch", "exchange": "", "redelivered": False}}
    try:
        tracer(parent_id, (), {}, request)
    finally:
        store.publishes.record_batch = real
    assert len(lost) == 1 and len(lost[0]) == 3, lost
    assert store.get(parent_id).status == PENDING  # given back by its outage, to run again
    left = [job.id for job in store.reports.list_jobs() if job.id != parent_id]
    assert left == [], f"the unsent group members {left} would run besides the group the next run publishes"


def run_python(script: str) -> None:
    """Run ``script`` in a fresh interpreter (nothing imported or installed yet); it must exit 0."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_importing_celery_lease_leaves_celerys_group_loop_as_it_is():
    run_python("""
import importlib, pkgutil
from celery.canvas import group
own = group._apply_tasks
import celery_lease, celery_lease.integration.task
for module in pkgutil.walk_packages(celery_lease.__path__, "celery_lease."):
    try:
        importlib.import_module(module.name)
    except Exception:
        pass  # a module that needs Django's settings or alembic's running migration
assert group._apply_tasks is own, group._apply_tasks
assert group._apply_tasks.__code__.co_filename.endswith("celery/canvas.py")
""")


def test_the_group_batching_is_installed_once_an_app_with_a_lease_task_is_finalised():
    run_python("""
from celery import Celery
from celery.canvas import group
from celery_lease import LeaseTask
own = group._apply_tasks

def noop():
    pass

plain = Celery("plain", set_as_current=False)
plain.task(shared=False, name="p")(noop)
plain.finalize()
assert group._apply_tasks is own, "an app without a LeaseTask installs nothing"

app = Celery("leased", set_as_current=False)
app.task(base=LeaseTask, shared=False, name="w")(noop)
assert group._apply_tasks is own, "a task of an app not finalised is not bound yet"
app.finalize()
assert group._apply_tasks is not own and group._apply_tasks.__wrapped__ is own
""")


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_group_of_plain_tasks_is_published_with_no_batch_open(app, batched_publishes):
    work, total = app.tasks["batch.work"], app.tasks["batch.total"]  # a LeaseTask bound: installed
    assert getattr(group._apply_tasks, "_celery_lease_batched", False)
    plain = group([total.s([i]) for i in range(3)]).apply_async()
    assert queued_ids(app, 3) == [r.id for r in plain.results]
    assert batched_publishes == [("batch.total", False)] * 3
    # The same hook sees the batch of a group of LeaseTasks.
    group([work.s(i) for i in range(2)]).apply_async()
    assert batched_publishes[3:] == [("batch.work", True)] * 2


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_group_of_chains_that_start_with_a_lease_task_publishes_them_in_one_batch(app, batched_publishes):
    work, total = app.tasks["batch.work"], app.tasks["batch.total"]
    result = group([chain(work.s(i), total.s()) for i in range(3)]).apply_async()
    ids = [r.parent.id for r in result.results]
    assert queued_ids(app, 3) == ids
    assert batched_publishes == [("batch.work", True)] * 3
    assert [for_app(app).get(job_id).status for job_id in ids] == [PENDING] * 3


def _celery_5_3(self, tasks, producer=None, app=None, p=None, add_to_parent=None, chord=None,
                args=None, kwargs=None, **options):
    yield from ()


def _celery_5_7(self, tasks, producer=None, app=None, p=None, add_to_parent=None, chord=None,
                args=None, kwargs=None, group_index=None, **options):
    yield from ()


@pytest.mark.parametrize("known", [_celery_5_3, _celery_5_7], ids=["5.3-5.5", "5.6-5.7"])
def test_the_group_loops_of_celery_5_3_to_5_7_are_wrapped(known, monkeypatch):
    monkeypatch.setattr(group, "_apply_tasks", known)
    assert batching.install() is True
    assert group._apply_tasks.__wrapped__ is known
    assert batching.install() is True and group._apply_tasks.__wrapped__ is known  # once


def _not_a_generator(self, tasks, producer=None, app=None, **options):
    return []


def _other_parameters(self, signatures, app=None, producer=None, **options):
    yield from ()


@pytest.mark.parametrize(("shape", "missing"), [
    (None, "celery.canvas.group has no _apply_tasks"),
    (_not_a_generator, "group._apply_tasks is not a generator function"),
    (_other_parameters, "does not begin with the parameters (self, tasks, producer, app)"),
], ids=["absent", "not-a-generator", "other-parameters"])
def test_a_group_loop_of_an_unknown_shape_is_left_alone_with_one_warning(shape, missing, monkeypatch, caplog):
    if shape is None:
        monkeypatch.delattr(group, "_apply_tasks")
    else:
        monkeypatch.setattr(group, "_apply_tasks", shape)
    monkeypatch.setattr(batching, "_refused", False)
    with caplog.at_level(logging.WARNING, logger=batching.__name__):
        assert batching.install() is False
        assert batching.install() is False
    assert getattr(group, "_apply_tasks", None) is shape
    [record] = [r for r in caplog.records if r.name == batching.__name__]
    assert record.levelno == logging.WARNING
    assert f"Celery {celery.__version__}: " in record.getMessage() and missing in record.getMessage()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_with_an_unknown_group_loop_a_group_publishes_each_job_alone(app, batched_publishes, monkeypatch):
    own = inspect.unwrap(group._apply_tasks)  # Celery's loop, under the wrapper if installed

    def _apply_tasks(self, *args, **kwargs):  # returns a list: a shape the wrapper does not know
        return list(own(self, *args, **kwargs))

    monkeypatch.setattr(group, "_apply_tasks", _apply_tasks)
    monkeypatch.setattr(batching, "_refused", False)
    work = app.tasks["batch.work"]  # binding a LeaseTask asks for the batching
    assert batching.install() is False and group._apply_tasks is _apply_tasks
    result = group([work.s(i) for i in range(4)]).apply_async()
    ids = [r.id for r in result.results]
    assert batched_publishes == [("batch.work", False)] * 4
    assert queued_ids(app, 4) == ids
    store = for_app(app)
    for job_id in ids:
        assert store.get(job_id).status == PENDING
        assert [e["event"] for e in store.reports.events(job_id)] == ["published"]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_group_that_fails_on_a_member_sends_the_members_before_it_as_celery_does(app):
    work = app.tasks["batch.work"]
    signature = group([work.s(1), work.s(2), work.s(object()), work.s(3)])  # the third cannot be encoded
    ids = [r.id for r in signature.freeze().results]
    with pytest.raises(kombu.exceptions.EncodeError):
        signature.apply_async()
    assert queued_ids(app, 2) == ids[:2]
    assert [for_app(app).get(job_id) is not None for job_id in ids] == [True, True, False, False]
