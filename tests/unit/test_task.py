"""LeaseTask's own call (celery_lease/integration/task.py) under apply(): the body runs under the tracer's
request as a plain task's does, a mixin's ``__call__`` still runs, and a direct call inside the body gets a
request of its own, as Celery's own ``Task.__call__`` gives it."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from celery_lease import LeaseTask
from tests.conftest import unique_prefix


def test_under_apply_a_mixins_call_runs_and_a_direct_call_in_the_body_sees_its_own_request(tmp_path):
    calls: list[str] = []

    class Traced(Task):
        def __call__(self, *args, **kwargs):
            calls.append("mixin")
            return super().__call__(*args, **kwargs)

    app = Celery(f"mixin_{unique_prefix()}", broker="memory://", set_as_current=False)
    app.conf.lease_store_url = f"sqlite:///{tmp_path / 'store.db'}"

    class Base(LeaseTask, Traced):
        abstract = True

    seen: list[Any] = []

    @app.task(base=Base, bind=True, shared=False, name="mixin.countdown")
    def countdown(self, n):
        seen.append(list(self.request.args))
        return countdown(n - 1) if n else 0

    assert countdown.apply((1,)).get() == 0
    assert seen == [[1], [0]] and calls.count("mixin") >= 1
