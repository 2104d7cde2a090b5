"""Publishing once per key, resuming from checkpoints and locks that outlive their holder, on real services.

Redis db 8 is the broker (the effects family's database); every store kind is tested.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_lease import LeaseTask, LockUnavailable, deadline
from celery_lease.config import load
from celery_lease.errors import StoreUnavailable
from celery_lease.store import ClaimTerms, for_app
from celery_lease.worker.lease import Lease
from celery_lease.worker.locks import lock
from celery_lease.worker.runtime import Runtime, current
from tests.conftest import drop_app_store, flushed_redis, migrated_store, unique_prefix
from tests.helpers import EMPTY_POLL, wait_for

pytestmark = pytest.mark.integration

REDIS_DB = 8
PUBLISHERS = 16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def broker(redis_url):
    with flushed_redis(redis_url, REDIS_DB) as (url, client):
        yield url, client


@pytest.fixture
def app(broker, store_url):
    app = Celery(f"effects_{unique_prefix()}", broker=broker[0], backend=broker[0], set_as_current=False)
    app.conf.update(
        lease_store_url=store_url, lease_table_prefix=unique_prefix(), lease_duration=2.0,
        lease_heartbeat_interval=0.4, lease_grace_period=0.5, worker_hijack_root_logger=False,
        result_expires=None, broker_transport_options={"polling_interval": EMPTY_POLL},
    )
    migrated_store(app)
    yield app
    rt = current(app)
    if rt is not None:
        rt.stop()
    drop_app_store(app)


def test_sixteen_publishers_of_one_key_make_one_job_and_one_message(app, broker):
    @app.task(base=LeaseTask, bind=True, shared=False, name="t.invoice")
    def invoice(self, order):
        return order

    barrier = threading.Barrier(PUBLISHERS)
    ids: list = [None] * PUBLISHERS

    def publish(i: int) -> None:
        barrier.wait()
        try:
            ids[i] = invoice.apply_async(("order-42",), idempotency_key="order-42:invoice").id
        except Exception as exc:  # noqa: BLE001 - the assertion below shows every outcome
            ids[i] = exc

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(PUBLISHERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # A publisher whose store call passed its bound (a third of the 2 s lease; a loaded machine
    # makes the 15 losers' waits on the winner's key that long) fails closed and sends nothing.
    published = [i for i in ids if isinstance(i, str)]
    assert published and all(isinstance(i, StoreUnavailable) for i in ids if not isinstance(i, str)), ids
    assert len(set(published)) == 1
    store = for_app(app)
    with store.begin(read=True) as c:
        jobs = c.execute(sa.select(store.t.jobs.c.id, store.t.jobs.c.idempotency_key)).all()
    assert jobs == [(published[0], "order-42:invoice")]
    assert broker[1].llen("celery") == 1, "the broker holds exactly one message"
    other = invoice.apply_async(("order-43",), idempotency_key="order-43:invoice")
    assert other.id != published[0] and broker[1].llen("celery") == 2


def test_a_retried_job_resumes_from_its_checkpoint_and_performs_its_effect_once(app, broker):
    seen: list[tuple] = []
    charges: list[str] = []

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.charge", max_retries=2)
    def charge(self, order):
        lease = self.lease
        seen.append((lease.attempt, lease.idempotency_key, lease.checkpoint_state))
        with lease.effect(f"charge:{order}") as first:
            if first:
                charges.append(order)
        if lease.attempt == 1:
            lease.checkpoint({"step": "charged"})
            raise self.retry(countdown=0)
        return charges.count(order)

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        keyed = charge.apply_async(("o-1",), idempotency_key="order-o-1")
        unkeyed = charge.apply_async(("o-2",))
        assert keyed.get(timeout=20) == 1
        assert unkeyed.get(timeout=20) == 1
        again = charge.apply_async(("o-1",), idempotency_key="order-o-1")
        assert again.id == keyed.id and again.get(timeout=5) == 1
    by_order = {key: [s for s in seen if s[1] == key] for key in ("order-o-1", f"t.charge:{unkeyed.id}")}
    assert by_order["order-o-1"] == [(1, "order-o-1", None), (2, "order-o-1", {"step": "charged"})]
    assert by_order[f"t.charge:{unkeyed.id}"] == [
        (1, f"t.charge:{unkeyed.id}", None), (2, f"t.charge:{unkeyed.id}", {"step": "charged"})]
    assert charges == ["o-1", "o-2"]


def test_a_lock_held_by_a_killed_process_frees_itself_after_its_ttl(app):
    store = for_app(app)
    prefix = app.conf.lease_table_prefix
    ttl = 1.5
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.apps.lock_holder", store.url, prefix, "holder-job", "account:42",
         str(ttl)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        line = holder.stdout.readline()
        assert line.startswith("held "), f"lock holder did not start: {line!r}"
        token = line.split()[1]
        first_expiry = store.reports.lock_holder("account:42")["expires_at"]
        # Alive, its heartbeat keeps the lock past the first ttl.
        wait_for(lambda: store.now() > first_expiry + 0.5, timeout=5, message="store clock")
        row = store.reports.lock_holder("account:42")
        assert row["token"] == token and row["expires_at"] > store.now()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(10)
        holder.stdout.close()

    rt = Runtime(store, "taker", default_interval=0.2, worker="taker:1")
    store.publishes.record("taker-job", "t.hold", "q", "{}", 3)
    sent = deadline.monotonic()
    got = store.jobs.claim("taker-job", rt.worker, "taker-token",
                           ClaimTerms(duration=3.0, grace=0.0, max_attempts=3, max_expirations=3,
                                      takeover=False),
                           task_name="t.hold", queue="q", payload=lambda: None)
    assert got.claimed
    policy = load({}).policy({"lease_duration": 30.0, "lease_heartbeat_interval": 0.2})
    lease = Lease(rt, "taker-job", "taker-token", 1, policy, "t.hold:taker-job", None, sent_at=sent)
    last_expiry = store.reports.lock_holder("account:42")["expires_at"]
    if store.now() < last_expiry - 0.2:
        with pytest.raises(LockUnavailable), lock(lease, "account:42", ttl=ttl, timeout=0):
            pytest.fail("the dead holder's lock was free before its ttl")
    with lock(lease, "account:42", ttl=ttl, timeout=ttl + 3) as held:
        taken_at = store.now()
        assert store.reports.lock_holder("account:42")["token"] == held.token
    assert taken_at >= last_expiry
    assert [e["worker"] for e in store.reports.events(event="lock_taken_after_expiry")] == ["taker:1"]
