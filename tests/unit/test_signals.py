"""Worker hooks: the pool checks made at worker start."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.errors import LeaseConfigError
from celery_lease.signals import check_pool, pool_name


def app_with(on_lost: str) -> Celery:
    app = Celery(f"signals_{on_lost}", set_as_current=False)
    app.conf.update(lease_store_url="sqlite://")

    @app.task(base=LeaseTask, shared=False, name="t.work", lease_on_lost=on_lost)
    def work():  # pragma: no cover - never called
        return None

    return app


def test_raise_on_lost_is_refused_in_the_eventlet_pool_at_worker_start():
    with pytest.raises(LeaseConfigError, match="lease_on_lost='raise' is invalid: cannot interrupt a body in "
                                               "the eventlet pool"):
        check_pool(app_with("raise"), "eventlet")


STARTS = [("flag", "eventlet"), ("raise", "gevent"), ("raise", "prefork"), ("raise", "threads")]


@pytest.mark.parametrize(("on_lost", "pool"), STARTS)
def test_every_other_pool_and_policy_starts(on_lost, pool):
    check_pool(app_with(on_lost), pool)


def test_the_pool_is_named_from_the_worker_setting_or_its_class():
    class Worker:
        def __init__(self, pool_cls):
            self.pool_cls, self.app = pool_cls, Celery("w", set_as_current=False)

    from celery.concurrency.eventlet import TaskPool

    assert pool_name(Worker("gevent")) == "gevent"
    assert pool_name(Worker(TaskPool)) == "eventlet"
