"""An app whose LeaseTask sets a lease too short for the default heartbeat: its worker must not start.

``@app.task(base=LeaseTask, lease_duration=20)`` with the default 10 s heartbeat breaks the rule
that a heartbeat runs at most every third of a lease. Store and broker come from BAD_STORE and
BAD_BROKER.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_lease import LeaseTask

app = Celery("bad_task_app", broker=os.environ.get("BAD_BROKER", "memory://"), set_as_current=False)
app.conf.update(lease_store_url=os.environ.get("BAD_STORE", "sqlite:///bad_task_app.sqlite3"),
                lease_table_prefix=os.environ.get("BAD_PREFIX", "bad_"), worker_hijack_root_logger=False)


@app.task(base=LeaseTask, name="bad.short_lease", lease_duration=20)
def short_lease() -> None:
    """Never runs: the worker refuses to start."""
