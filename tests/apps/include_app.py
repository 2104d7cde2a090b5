"""An app whose LeaseTasks live only in a module listed in ``include=`` (as many real apps do).

Nothing here imports ``tests.apps.include_tasks``: a command sees those tasks only when it
loads the app's task modules the way ``celery worker`` does. Store from INC_STORE, table
prefix from INC_PREFIX.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("include_app", broker="memory://", include=["tests.apps.include_tasks"], set_as_current=False)
app.conf.update(
    lease_store_url=os.environ.get("INC_STORE", "sqlite:///include_app.sqlite3"),
    lease_table_prefix=os.environ.get("INC_PREFIX", "inc_"),
    lease_worker_stale_after=60.0, lease_reaper_hard_grace=600.0, task_ignore_result=True,
)
