"""Task.replace() under leases: the replacement runs once and the replaced job's lease ends with it."""

from __future__ import annotations

import secrets

import pytest
from celery import chain, group
from celery.contrib.testing.worker import start_worker

from celery_lease import LeaseTask
from celery_lease.errors import StoreUnavailable
from celery_lease.ops.views import job_timeline
from celery_lease.store import for_app
from celery_lease.vocabulary import RECOVERIES, RELEASES, Event
from tests.conftest import drop_app_store, flushed_redis, migrated_store
from tests.helpers import wait_for
from tests.integration.test_leased_execution import make_app

pytestmark = pytest.mark.integration

REDIS_DB = 14


@pytest.fixture
def counted(redis_url, postgres_url):
    with flushed_redis(redis_url, REDIS_DB) as (url, client):
        # No test here waits for a lease to expire: a longer one keeps the store's call bound (a third
        # of it) above a loaded machine's slow commits, which would end a body as an outage.
        app = make_app(url, postgres_url, lease_duration=6.0, lease_heartbeat_interval=0.5)

        def ran(task):
            client.incr(f"runs:{task.name}:{task.request.id}")

        @app.task(base=LeaseTask, bind=True, shared=False, name="r.add")
        def add(self, x, y):
            ran(self)
            return x + y

        @app.task(base=LeaseTask, bind=True, shared=False, name="r.by_add")
        def by_add(self, x, depth=0):
            ran(self)
            if depth:
                return self.replace(by_add.s(x, depth - 1))
            return self.replace(add.s(x, 1))

        @app.task(base=LeaseTask, bind=True, shared=False, name="r.by_chain")
        def by_chain(self, x):
            ran(self)
            return self.replace(chain(add.s(x, 1), add.s(10)))

        @app.task(base=LeaseTask, bind=True, shared=False, name="r.by_group")
        def by_group(self, n):
            ran(self)
            return self.replace(group(add.s(i, i) for i in range(n)))

        @app.task(base=LeaseTask, bind=True, shared=False, name="r.held")
        def held(self, x):
            ran(self)
            wait_for(lambda: client.get("go"), timeout=30, message="the test never let the step go on")
            return x

        @app.task(base=LeaseTask, bind=True, shared=False, name="r.by_held_chain")
        def by_held_chain(self, x):
            ran(self)
            return self.replace(chain(held.s(x), add.s(10)))

        migrated_store(app)
        yield app, client
        drop_app_store(app)


def runs(client) -> dict[str, int]:
    return {key.decode(): int(client.get(key)) for key in client.scan_iter("runs:*")}


def unexplained(app, counts: dict[str, int]) -> dict[str, tuple[int, list[str]]]:
    """The bodies that ran other than once per run the store records: a run ends early only by giving
    its lease back (an outage in the body) or by losing it to a recovery, and each says so."""
    store = for_app(app)
    odd = {}
    for key, count in counts.items():
        job_id = key.rsplit(":", 1)[1]
        stored = [e["event"] for e in store.reports.events(job_id)]
        again = sum(1 for e in stored if e in RELEASES or e in RECOVERIES)
        if count != 1 + again:
            odd[key] = (count, stored)
    return odd


def events(app, job_id):
    return [e["event"] for e in for_app(app).reports.events(job_id)]


def timeline(app, job_id):
    """The job's stored events with the claims and completion its row records (lease events --job)."""
    store = for_app(app)
    return [e["event"] for e in job_timeline(store.get(job_id), store.reports.events(job_id))]


def test_a_replacement_runs_once_and_claims_the_replaced_job(counted):
    app, client = counted
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["r.by_add"].delay(1)
        assert result.get(timeout=20) == 2
    assert runs(client) == {f"runs:r.by_add:{result.id}": 1, f"runs:r.add:{result.id}": 1}
    # Stored: the decisions (the hand-over, the replacement's claim of a job that ran before).
    assert events(app, result.id) == [Event.PUBLISHED, Event.HANDED_OVER, Event.CLAIMED]
    assert timeline(app, result.id) == [Event.PUBLISHED, Event.CLAIMED, Event.HANDED_OVER, Event.CLAIMED,
                                        Event.COMPLETED]
    job = for_app(app).get(result.id)
    assert (job.status, job.attempt_count, job.task_name) == ("completed", 1, "r.by_add")


def test_a_chain_continues_after_a_nested_replacement(counted):
    app, client = counted
    add = app.tasks["r.add"]
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = chain(app.tasks["r.by_add"].s(1, depth=2), add.s(100)).delay()
        assert result.get(timeout=20) == 102
    job_id = result.parent.id
    # Three replaced bodies under one id, then the carrier, then the chain's last step.
    assert runs(client) == {f"runs:r.by_add:{job_id}": 3, f"runs:r.add:{job_id}": 1,
                            f"runs:r.add:{result.id}": 1}
    assert events(app, job_id).count(Event.HANDED_OVER) == 3


def test_a_replacement_chain_records_its_last_step_when_it_is_sent(counted):
    app, client = counted
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["r.by_chain"].delay(1)
        assert result.get(timeout=20) == 12
    assert sorted(runs(client).values()) == [1] * 3
    # The row was recorded again by the carrier's publish: its claim is that row's first.
    assert events(app, result.id) == [Event.PUBLISHED, Event.HANDED_OVER, Event.PUBLISHED]
    assert timeline(app, result.id) == [Event.PUBLISHED, Event.CLAIMED, Event.HANDED_OVER, Event.PUBLISHED,
                                        Event.CLAIMED, Event.COMPLETED]
    assert for_app(app).get(result.id).task_name == "r.add"


def test_a_group_replacement_ends_the_lease_and_gives_the_group_result(counted):
    app, client = counted
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["r.by_group"].delay(3)
        assert result.get(timeout=20) == [0, 2, 4]
    counts = runs(client)
    assert unexplained(app, counts) == {}
    # The replaced body and the group's three members (a body given back sends a group of its own).
    assert counts[f"runs:r.by_group:{result.id}"] >= 1 and len(counts) >= 4
    job = for_app(app).get(result.id)
    assert job.status == "completed" and events(app, result.id)[-1] == Event.REPLACED
    store = for_app(app)
    with store.begin() as c:
        names = {r[0] for r in c.execute(store.t.jobs.select().with_only_columns(store.t.jobs.c.task_name))}
    assert names == {"r.by_group", "r.add"}  # celery.accumulate carries the id, unleased


def test_a_group_replacement_whose_record_meets_an_outage_runs_the_replaced_body_once_more(
        counted, monkeypatch):
    """The group's members are recorded by the replaced body: a store that does not answer then ends the
    run as an outage, its lease is given back, and the body runs again; the group it could not record
    never left, so each member runs once."""
    app, client = counted
    statements = type(for_app(app).publishes)
    record_batch, calls = statements.record_batch, []

    def unanswered_once(self, jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise StoreUnavailable("no answer within the call bound (injected)")
        return record_batch(self, jobs)

    monkeypatch.setattr(statements, "record_batch", unanswered_once)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["r.by_group"].delay(3)
        assert result.get(timeout=30) == [0, 2, 4]
    counts = runs(client)
    assert calls == [3, 3]
    assert counts.pop(f"runs:r.by_group:{result.id}") == 2
    assert sorted(counts.values()) == [1, 1, 1]
    assert Event.RELEASED_AFTER_OUTAGE in events(app, result.id)
    assert unexplained(app, runs(client)) == {}


def test_a_replacement_sent_before_the_store_stopped_answering_runs_once_and_its_body_once(
        counted, monkeypatch):
    """Celery has sent the group (its carrier unleased) when the hand-over's write finds the store away: the
    write waits for the store, as a completion's does; the job is not given back to run and replace again."""
    app, client = counted
    statements = type(for_app(app).replacing)
    replaced, calls = statements.replaced, []

    def unanswered_once(self, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            raise StoreUnavailable("no answer within the call bound (injected)")
        return replaced(self, *args, **kwargs)

    monkeypatch.setattr(statements, "replaced", unanswered_once)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["r.by_group"].delay(3)
        assert result.get(timeout=30) == [0, 2, 4]
        wait_for(lambda: for_app(app).get(result.id).status == "completed", timeout=20,
                 message="the deferred hand-over never landed")
    counts = runs(client)
    assert calls == [result.id, result.id]
    assert counts.pop(f"runs:r.by_group:{result.id}") == 1
    assert sorted(counts.values()) == [1, 1, 1]
    assert Event.RELEASED_AFTER_OUTAGE not in events(app, result.id)
    assert events(app, result.id)[-1] == Event.REPLACED


def test_a_copy_of_the_replaced_message_delivered_mid_chain_does_not_replace_the_job_again(counted):
    """While the chain's first step runs, the job has no row (its carrier is recorded when it is
    sent): a broker's copy of the replaced task's message is skipped, not run as a new job."""
    app, client = counted
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["r.by_held_chain"].delay(1)
        wait_for(lambda: Event.HANDED_OVER in events(app, result.id), timeout=20,
                 message="the job was never handed over to its chain")
        app.send_task("r.by_held_chain", args=(1,), task_id=result.id)  # a copy, as a broker redelivers
        wait_for(lambda: Event.DUPLICATE_DELIVERY_SKIPPED in events(app, result.id), timeout=20,
                 message="the copy of the replaced message was not skipped")
        client.set("go", 1)
        assert result.get(timeout=20) == 11
        wait_for(lambda: (for_app(app).get(result.id) or None) is not None
                 and for_app(app).get(result.id).status == "completed", timeout=20,
                 message="the carrier never completed the job")
    counts = runs(client)
    assert counts[f"runs:r.by_held_chain:{result.id}"] == 1
    assert counts[f"runs:r.add:{result.id}"] == 1
    assert sum(n for key, n in counts.items() if key.startswith("runs:r.held:")) == 1


def test_a_copy_of_the_replaced_message_sends_the_chains_pending_first_step_again(counted):
    """A hand-over to a chain whose answer was lost ends its run as an outage before the chain is
    sent: the store holds the first step's pending row and nothing carries it. The copy of the
    replaced message that the outage sends is skipped, and sends the first step instead."""
    from celery_lease.messaging import messages
    from celery_lease.store import ClaimTerms, NewJob

    app, client = counted
    store, queue = for_app(app), app.conf.task_default_queue
    job_id, step_id = "replaced-" + secrets.token_hex(4), "step-" + secrets.token_hex(4)
    store.publishes.record(job_id, "r.by_held_chain", queue, None, 3)
    terms = ClaimTerms(duration=30.0, grace=1.0, max_attempts=3, max_expirations=3, takeover=True)
    token = secrets.token_hex(16)
    assert store.jobs.claim(job_id, "gone-worker", token, terms, task_name="r.by_held_chain", queue=queue,
                            payload=lambda: None).claimed
    step = NewJob(step_id, "r.add", queue, messages.encode("r.add", (1, 1), {}, {}), 3)
    assert store.replacing.hand_over_to_step(job_id, token, "gone-worker", "r.add", step,
                                             0) is True  # never sent
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        app.send_task("r.by_held_chain", args=(1,), task_id=job_id)  # the run's own copy
        wait_for(lambda: getattr(store.get(step_id), "status", None) == "completed", timeout=20,
                 message="the chain's first step was never sent again")
        assert Event.DUPLICATE_DELIVERY_SKIPPED in events(app, job_id)
    assert runs(client) == {f"runs:r.add:{step_id}": 1}  # the replaced body did not run again
