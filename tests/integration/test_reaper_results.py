"""The reaper's runs leave nothing in the result backend (a real prefork worker, Redis db 7).

django-celery-results and every other backend would otherwise get a row per run, every few
seconds, and a REVOKED row for each run that expired in the queue.
"""

from __future__ import annotations

import datetime

import pytest
import redis

from tests.helpers import wait_for
from tests.reaper_env import APP
from tests.workers import celery_processes, worker

pytestmark = pytest.mark.integration


def test_reaper_runs_store_no_result_and_no_revoked_state_for_expired_runs(renv, tmp_path):
    # Results on for every task, STARTED tracked, as a Django project with django-celery-results has it.
    conf = {"task_ignore_result": False, "result_backend": renv.broker_url, "task_track_started": True}
    app = renv.app(**conf)
    results = redis.Redis.from_url(renv.broker_url)
    reap, work = app.tasks["celery_lease.reap"], app.tasks["reaper_app.work"]
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    sent = []
    try:
        with celery_processes(tmp_path) as procs:
            # One queue, one process: the worker takes the three messages in this order.
            sent.append(expired := reap.apply_async(queue=renv.queue, expires=past))
            sent.append(ran := reap.apply_async(queue=renv.queue))
            sent.append(after := work.apply_async((0.0,), queue=renv.queue))
            procs.append(worker(APP, renv.env(**conf), tmp_path, pool="prefork", queues=renv.queue))
            wait_for(lambda: after.state == "SUCCESS", timeout=30,
                     message="the task after the reaper never ran")
        assert renv.store.runs.last_reaper_run()[1] is not None  # the reaper did run, and recorded it
        assert f"Discarding revoked task: celery_lease.reap[{expired.id}]" in procs[0].output()
        stored = {name: results.get(f"celery-task-meta-{r.id}") for name, r in
                  (("expired", expired), ("ran", ran))}
        assert stored == {"expired": None, "ran": None}
    finally:
        for r in sent:
            results.delete(f"celery-task-meta-{r.id}")
        results.close()
