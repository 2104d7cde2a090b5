"""The run lifecycle (an eager run's retry), and how far one delivery travels through the library: the
modules it enters and how often control leaves the lifecycle module (celery_lease/worker/lifecycle.py),
measured under ``sys.setprofile``.

The path measured is a prefork child's: the claim succeeds and the body returns. The bounds are the
figures of today's code (13 modules, 6 departures: the settle step is part of the lifecycle module, so its
two calls out count), so a change that spreads a delivery over more modules, or adds a crossing out of the
lifecycle, fails here and says where the path went. The layering's target is 8 modules and 6 departures:
the departures meet it; the modules do not (the store's engine, audited writes, dialect, statements and
rows are modules of their own), and each change that reaches closer lowers the bound. A delivery after
the first reads its policy, claim terms and store from the runtime; an app whose store follows a Django
database still looks the store up on every delivery (config, app_state and the store package: 16).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer

from celery_lease import LeaseTask
from celery_lease.store import Store
from celery_lease.vocabulary import Status
from tests.conftest import unique_prefix

LIFECYCLE = "celery_lease.worker.lifecycle"
# Today's figures (see the module docstring).
MAX_MODULES = 13
MAX_DEPARTURES = 6


@pytest.fixture
def leased_add(tmp_path) -> Any:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    app = Celery(f"path_{unique_prefix()}", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(lease_store_url=url, lease_duration=30.0)

    @app.task(base=LeaseTask, bind=True, name="path.add", acks_late=True, shared=False)
    def add(self: Any, a: int, b: int) -> int:
        return a + b

    app.finalize()
    Store(url).migrate()
    return add


def _deliver(task: Any, profile: Any = None) -> tuple[str, Any]:
    """Publish one job, then run its delivery as a prefork child's tracer does."""
    job_id = task.apply_async((1, 2)).id
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=True)
    request = {"id": job_id, "task": task.name, "hostname": "path@test", "headers": {}, "is_eager": False,
               "delivery_info": {"routing_key": "celery", "exchange": "", "redelivered": False}}
    sys.setprofile(profile)
    try:
        value = tracer(job_id, (1, 2), {}, request)[0]
    finally:
        sys.setprofile(None)
    return job_id, value


def test_one_delivery_enters_no_more_library_modules_and_leaves_the_lifecycle_no_more_often(leased_add):
    _deliver(leased_add)  # the first delivery sets up the process's runtime; it is not measured
    entered: Counter[str] = Counter()
    departures: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("celery_lease"):
            return
        entered[module] += 1
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller == LIFECYCLE and module != LIFECYCLE:
            departures.append(f"{module}.{frame.f_code.co_name}")

    # In a thread of its own, joined with a deadline: a delivery that never ends fails here rather
    # than hanging the suite.
    measured: list[tuple[str, Any]] = []
    runner = threading.Thread(target=lambda: measured.append(_deliver(leased_add, profile)), daemon=True)
    runner.start()
    runner.join(60)
    assert measured, "the measured delivery did not end within 60 s"
    job_id, value = measured[0]

    assert value == 3
    job = Store(leased_add.app.conf.lease_store_url).get(job_id)
    assert job is not None and job.status == Status.COMPLETED
    assert LIFECYCLE in entered, "the delivery did not run through the lifecycle module"
    assert len(entered) <= MAX_MODULES, f"{len(entered)} modules entered: {sorted(entered)}"
    assert len(departures) <= MAX_DEPARTURES, f"{len(departures)} departures from the lifecycle: {departures}"


def test_an_eager_run_with_a_store_retries_at_once_as_celerys_apply_does(tmp_path):
    app = Celery(f"eager_{unique_prefix()}", broker="memory://", set_as_current=False)
    app.conf.update(lease_eager_store=True, lease_store_url=f"sqlite:///{tmp_path / 'store.db'}")
    attempts: list[int] = []

    @app.task(base=LeaseTask, bind=True, name="path.flaky", shared=False, max_retries=2)
    def flaky(self: Any) -> str:
        attempts.append(self.request.retries)
        if self.request.retries < 1:
            raise self.retry(countdown=60)  # the countdown an eager apply() does not wait for
        return "ok"

    Store(app.conf.lease_store_url).migrate()
    result = flaky.apply(task_id="eager-retry")
    assert (result.state, result.result, attempts) == ("SUCCESS", "ok", [0, 1])
    assert Store(app.conf.lease_store_url).get("eager-retry").status == Status.COMPLETED
