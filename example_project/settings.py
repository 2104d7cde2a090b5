"""Settings of the example shop (``app.config_from_object("example_project.settings")``).

With no environment set, everything lives in SQLite files under ``EXAMPLE_RUN_DIR``
(default: ``$TMPDIR/celery_lease_example``) and no server is needed: the lease store is a
SQLite file and the broker is kombu's SQLAlchemy transport on a second file. Two
variables move the shop to production services:

    CELERY_BROKER_URL=redis://127.0.0.1:6379/11
    EXAMPLE_LEASE_STORE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test

The shop's own tables (invoices, reports) live in the lease store's database, so an
invoice and its effect key commit in one transaction. ``EXAMPLE_TABLE_PREFIX`` (default
``shop_``) prefixes every table the shop and celery_lease create there.

The lease timings are the demo's: short enough to watch a recovery in seconds. A real
shop would keep the defaults (lease 30 s, heartbeat 10 s, grace 10 s) and run the
reaper every 15 s.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

RUN_DIR = Path(os.environ.get("EXAMPLE_RUN_DIR") or Path(tempfile.gettempdir()) / "celery_lease_example")
TABLE_PREFIX = os.environ.get("EXAMPLE_TABLE_PREFIX", "shop_")

# -- Celery -------------------------------------------------------------------------
broker_url = os.environ.get("CELERY_BROKER_URL") or f"sqlite:///{RUN_DIR / 'broker.sqlite3'}"
if broker_url.startswith("sqlite:"):
    # The embedded broker (see broker.py). It polls the file; 0.1 s keeps the demo brisk.
    broker_transport = "example_project.broker:Transport"
    broker_transport_options = {"polling_interval": 0.1}
broker_connection_retry_on_startup = True
result_backend = None  # the shop reads outcomes from its own tables, not from results
task_ignore_result = True

task_default_queue = "shop"
MAINTENANCE_QUEUE = "shop_maintenance"
task_routes = {"celery_lease.reap": {"queue": MAINTENANCE_QUEUE}}

# What a careful Celery user sets for work that must not be lost: acknowledge after the
# task ran and take one message at a time. Both modes of the demo run with these, so the
# comparison is fair to Celery. The plain mode also gives a message back when its pool
# process dies (task_reject_on_worker_lost, set in celery.py); under celery_lease that stays
# off, as `lease check` advises: the lease's owner is gone and the job is requeued from the
# store, with its attempts counted, instead of the broker redelivering it without a limit.
task_acks_late = True
worker_prefetch_multiplier = 1

# -- celery_lease -----------------------------------------------------------------------
lease_store_url = os.environ.get("EXAMPLE_LEASE_STORE_URL") or f"sqlite:///{RUN_DIR / 'lease.sqlite3'}"
lease_table_prefix = f"{TABLE_PREFIX}lease_"
lease_duration = 3.0            # seconds a lease lasts without a heartbeat
lease_heartbeat_interval = 0.5  # at most a third of the lease
lease_grace_period = 1.0        # the reaper waits this long past expiry
lease_worker_stale_after = 3.0  # a worker process silent this long counts as gone
lease_reaper_hard_grace = 10.0  # ... and a lease this far past expiry is taken even from a live one
lease_backoff_base = 0.5        # first requeue delay, doubling per attempt, with full jitter
lease_backoff_max = 2.0
lease_dispatch_timeout = 60.0   # a pending job may wait this long in the queue (20 jobs fit)
lease_max_attempts = 5
lease_audit_every_transition = True  # the demo's timelines and checks read every claim and completion

# The reaper, every second, on its own queue: a worker busy with long jobs must not hold
# it up. A run that waited past its interval is dropped; the next one does its work.
REAPER_INTERVAL = 1.0
beat_schedule = {
    "lease-reaper": {
        "task": "celery_lease.reap",
        "schedule": REAPER_INTERVAL,
        "options": {"expires": 2 * REAPER_INTERVAL},
    },
}
