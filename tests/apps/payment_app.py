"""The payment app that the chaos test's real workers run.

Configured from the environment: PAYMENT_BROKER (Redis db 8), PAYMENT_STORE (the lease
store's database, which also holds the ledger) and PAYMENT_PREFIX. Fast settings: 2 s
leases, 0.4 s heartbeats, 0.5 s grace, owners stale after 1 s.

``payment_app.capture`` writes one ledger row per payment through
``lease.effect(connection=...)``; the ledger's primary key is the payment id (the unique
business key). Attempt 1 can be told to stop and wait for ``go:<payment>`` in Redis
``before`` its effect, ``in_transaction`` (key written, not committed) or ``after`` the
commit, so the test can SIGSTOP its worker exactly there. It reports to Redis:
``started:<payment>`` (attempt:pid), ``captures:<payment>`` (each time it saw ``first``)
and ``refused:<payment>`` (each LeaseLost from the effect).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from celery_lease import LeaseLost, LeaseTask

DEFAULTS = {
    "PAYMENT_BROKER": "redis://127.0.0.1:6379/8",
    "PAYMENT_STORE": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "PAYMENT_PREFIX": "payment_",
}
SETTINGS = dict(
    lease_duration=2.0, lease_heartbeat_interval=0.4, lease_grace_period=0.5, lease_worker_stale_after=1.0,
    lease_reaper_hard_grace=5.0, lease_backoff_base=0.1, lease_backoff_max=0.3, lease_reaper_lock_ttl=3.0,
    # One unacknowledged message per worker: a stopped worker holds only its own job's message.
    task_acks_late=True, worker_prefetch_multiplier=1, task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)
HOLD_TIMEOUT = 60.0  # seconds an attempt waits for its go flag


def ledger_table(prefix: str) -> sa.Table:
    """One row per captured payment; a second capture of a payment cannot be written."""
    return sa.Table(
        f"{prefix}ledger", sa.MetaData(),
        sa.Column("payment_id", sa.String(64), primary_key=True),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
    )


def make_app(env: Mapping[str, str]) -> Celery:
    """The app from an environment (the test process builds its twin to publish and reap)."""
    conf = {key: env.get(key, default) for key, default in DEFAULTS.items()}
    app = Celery("payment_app", broker=conf["PAYMENT_BROKER"], set_as_current=False)
    app.conf.update(lease_store_url=conf["PAYMENT_STORE"], lease_table_prefix=conf["PAYMENT_PREFIX"],
                    **SETTINGS)
    ledger = ledger_table(conf["PAYMENT_PREFIX"])
    # NullPool: a forked pool child opens its own connections.
    engine = sa.create_engine(conf["PAYMENT_STORE"], poolclass=sa.NullPool)
    reports = redis.Redis.from_url(conf["PAYMENT_BROKER"])

    def hold(payment_id: str) -> None:
        reports.set(f"holding:{payment_id}", os.getpid())
        deadline = time.monotonic() + HOLD_TIMEOUT
        pause = threading.Event()
        while not reports.get(f"go:{payment_id}") and time.monotonic() < deadline:
            pause.wait(0.05)

    @app.task(base=LeaseTask, bind=True, shared=False, name="payment_app.capture", lease_on_lost="flag")
    def capture(self: Any, payment_id: str, amount: int, hold_at: str | None = None) -> dict[str, Any]:
        lease = self.lease
        reports.rpush(f"started:{payment_id}", f"{lease.attempt}:{os.getpid()}")
        stop_at = hold_at if lease.attempt == 1 else None
        if stop_at == "before":
            hold(payment_id)
        try:
            with engine.begin() as conn, lease.effect(f"capture:{payment_id}", connection=conn) as first:
                if first:
                    reports.rpush(f"captures:{payment_id}", f"{lease.attempt}:{os.getpid()}")
                    conn.execute(ledger.insert().values(payment_id=payment_id, amount=amount,
                                                        job_id=self.request.id, attempt=lease.attempt,
                                                        pid=os.getpid()))
                if stop_at == "in_transaction":
                    hold(payment_id)
        except LeaseLost:
            reports.rpush(f"refused:{payment_id}", lease.attempt)
            raise
        if stop_at == "after":
            hold(payment_id)
        return {"attempt": lease.attempt, "first": first}

    return app


app = make_app(os.environ)
