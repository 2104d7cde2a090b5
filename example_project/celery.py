"""The shop's Celery app: settings from ``example_project.settings``, tasks on LeaseTask.

``EXAMPLE_MODE=plain`` (the demo's ``--mode plain``) builds the same app with plain
Celery tasks and without the reaper, to show what celery_lease changes.
"""

from __future__ import annotations

import os

from celery import Celery, Task, signals

MODE = os.environ.get("EXAMPLE_MODE", "lease")
if MODE not in ("lease", "plain"):
    raise ValueError(f"EXAMPLE_MODE={MODE!r}: use 'lease' (the default) or 'plain'")

BaseTask: type[Task]
if MODE == "lease":
    from celery_lease import LeaseTask  # importing celery_lease registers the celery_lease.reap task

    BaseTask = LeaseTask
else:
    from .plain import PlainTask

    BaseTask = PlainTask

app = Celery("example_project", include=["example_project.tasks"])
app.config_from_object("example_project.settings")
if MODE == "plain":
    app.conf.beat_schedule = {}
    app.conf.task_reject_on_worker_lost = True  # plain Celery's own answer to a lost pool process


@signals.worker_init.connect
def _create_shop_tables(**_: object) -> None:
    from . import shop

    shop.migrate()
