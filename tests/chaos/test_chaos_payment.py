"""A payment worker SIGSTOPped past its lease while another worker takes the job over.

Two real prefork workers (Redis db 8, PostgreSQL store). For each payment, attempt 1's
worker is stopped at one point of the capture: ``before`` its effect, ``in_transaction``
(effect key written, transaction open) or ``after`` the commit. The reaper (run from
the test) requeues the job once its lease and grace are past, the other worker runs
attempt 2, and then the stopped worker is continued. The ledger must hold exactly one
capture per payment, and the stale worker must change nothing that is audited as
rejected.
"""

from __future__ import annotations

import os
import signal

import pytest
import redis
import sqlalchemy as sa

from celery_lease.reaper.run import Reaper
from celery_lease.store import Store
from tests.apps.payment_app import ledger_table, make_app
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.reaper_env import reap_round
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

BROKER_DB = 8
CASES = {"p-before": "before", "p-in-transaction": "in_transaction", "p-after": "after"}


@pytest.fixture
def env(redis_url, postgres_url):
    broker = redis_url.rsplit("/", 1)[0] + f"/{BROKER_DB}"
    client = redis.Redis.from_url(broker, decode_responses=True)
    client.flushdb()
    prefix = unique_prefix()
    store = Store(postgres_url, prefix)
    store.migrate()
    ledger = ledger_table(prefix)
    ledger.create(store.engine)
    yield {"PAYMENT_BROKER": broker, "PAYMENT_STORE": postgres_url, "PAYMENT_PREFIX": prefix}, store, client
    ledger.drop(store.engine)
    store.t.metadata.drop_all(store.engine)
    store.engine.dispose()
    client.flushdb()
    client.close()


def reap_until(reaper: Reaper, done, timeout: float, message: str) -> None:
    """Run reaper rounds (as beat would) until ``done()`` holds."""

    def round_then_check():
        reap_round(reaper)
        return done()

    wait_for(round_then_check, timeout=timeout, interval=0.25, message=message)


def test_stopped_payment_worker_never_captures_twice(env, tmp_path):
    env_vars, store, reports = env
    app = make_app(env_vars)
    capture = app.tasks["payment_app.capture"]
    reaper = Reaper(app)
    ledger = ledger_table(env_vars["PAYMENT_PREFIX"])
    with celery_processes(tmp_path) as procs:
        procs.extend(worker("tests.apps.payment_app", env_vars, tmp_path) for _ in range(2))
        for payment, hold_at in CASES.items():
            first = capture.apply_async((payment, 100, hold_at), idempotency_key=f"payment:{payment}")
            again = capture.apply_async((payment, 100, hold_at), idempotency_key=f"payment:{payment}")
            assert again.id == first.id, "a second publish of the key returns the first job"
            child = int(wait_for(lambda p=payment: reports.get(f"holding:{p}"), timeout=30,
                                 message=f"{payment}: attempt 1 never reached its stop point"))
            stopped = next(p for p in procs if os.getpgid(child) == p.pid)
            stopped.signal(signal.SIGSTOP)
            try:
                reap_until(reaper, lambda p=payment: len(reports.lrange(f"started:{p}", 0, -1)) >= 2, 20,
                           f"{payment}: the job was not taken over")
                if hold_at != "in_transaction":
                    # Attempt 2 finishes while attempt 1 is still frozen.
                    wait_for(lambda j=first.id: store.get(j).status == "completed", timeout=20,
                             message=f"{payment}: the new owner did not complete the job")
                else:
                    # Attempt 2 reached the effect and waits on the open transaction's key.
                    wait_for(lambda p=payment: _waiting_on_a_lock(store), timeout=10,
                             message=f"{payment}: attempt 2 is not waiting on the uncommitted key")
            finally:
                reports.set(f"go:{payment}", 1)
                stopped.signal(signal.SIGCONT)
            expected = "refused" if hold_at == "before" else "stale_completion_rejected"
            wait_for(lambda p=payment, j=first.id, e=expected: _stale_outcome(store, reports, p, j) == e,
                     timeout=20, message=f"{payment}: the stale worker's outcome was not {expected}")
            wait_for(lambda j=first.id: store.get(j).status == "completed", timeout=20,
                     message=f"{payment}: job not completed")

        with store.begin() as c:
            rows = c.execute(sa.select(ledger.c.payment_id, ledger.c.attempt)
                             .order_by(ledger.c.payment_id)).all()
    # Exactly one capture per payment, and exactly one attempt ever saw ``first``.
    assert sorted(r.payment_id for r in rows) == sorted(CASES)
    assert {r.payment_id: r.attempt for r in rows} == {
        "p-before": 2, "p-in-transaction": 1, "p-after": 1}
    for payment in CASES:
        assert len(reports.lrange(f"captures:{payment}", 0, -1)) == 1, payment
        job = store.get(_job_of(store, payment))
        assert (job.status, job.attempt_count) == ("completed", 2), payment
        assert store.reports.effect_keys(job.id) == [f"capture:{payment}"]
    assert reports.lrange("refused:p-before", 0, -1) == ["1"]
    rejected = store.reports.events(event="stale_completion_rejected")
    assert sorted(_payment_of(store, e["job_id"]) for e in rejected) == ["p-after", "p-in-transaction"]
    assert store.reports.events(event="failed") == []


def _waiting_on_a_lock(store: Store) -> bool:
    with store.begin() as c:
        return bool(c.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :q"
        ), {"q": f"%{store.t.effects.name}%"}).scalar())


def _stale_outcome(store: Store, reports: redis.Redis, payment: str, job_id: str) -> str | None:
    if reports.lrange(f"refused:{payment}", 0, -1):
        return "refused"
    if store.reports.events(job_id, "stale_completion_rejected"):
        return "stale_completion_rejected"
    return None


def _job_of(store: Store, payment: str) -> str:
    j = store.t.jobs
    with store.begin() as c:
        return c.execute(sa.select(j.c.id).where(j.c.idempotency_key == f"payment:{payment}")).scalar_one()


def _payment_of(store: Store, job_id: str) -> str:
    return store.get(job_id).idempotency_key.removeprefix("payment:")

