"""LeaseTask composed with Django's DjangoTask: delay_on_commit and apply_async_on_commit record
and publish once the transaction commits, and an idempotency key still publishes once."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from celery import Celery

from celery_lease import LeaseTask
from tests.conftest import drop_app_store, migrated_store, unique_prefix

django = pytest.importorskip("django")
# DjangoTask exists from Celery 5.4; the floor-versions run has 5.3, where only the refusal applies.
HAS_DJANGO_TASK = importlib.util.find_spec("celery.contrib.django") is not None


@pytest.fixture(scope="module")
def transaction():
    from django.conf import settings

    if not settings.configured:
        database = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
        settings.configure(DATABASES={"default": database}, INSTALLED_APPS=[], USE_TZ=True)
        django.setup()
    from django.db import transaction

    return transaction


@pytest.fixture
def app(tmp_path, transaction):
    if not HAS_DJANGO_TASK:
        pytest.skip("celery.contrib.django.task.DjangoTask exists from Celery 5.4 (this is the 5.3 floor)")
    app = Celery(f"django_{unique_prefix()}", broker="memory://", set_as_current=False,
                 task_cls="celery_lease.django:LeaseDjangoTask")
    app.conf.update(lease_store_url=f"sqlite:///{tmp_path}/store.db", lease_table_prefix=unique_prefix())

    @app.task(shared=False, name="dj.notify")
    def notify(order):
        return order

    store = migrated_store(app)
    yield app, store
    drop_app_store(app)


def jobs(store):
    with store.begin() as c:
        return [(r.task_name, r.idempotency_key) for r in c.execute(store.t.jobs.select())]


def test_the_composed_task_is_both_a_lease_task_and_a_django_task(app):
    from celery.contrib.django.task import DjangoTask

    app, _ = app
    task = app.tasks["dj.notify"]
    assert isinstance(task, LeaseTask) and isinstance(task, DjangoTask)


def test_delay_on_commit_records_and_publishes_after_the_commit(app, transaction):
    app, store = app
    notify = app.tasks["dj.notify"]
    with transaction.atomic():
        notify.delay_on_commit("o-1")
        assert jobs(store) == []
    assert jobs(store) == [("dj.notify", None)]


def test_a_rolled_back_transaction_publishes_nothing(app, transaction):
    app, store = app
    with pytest.raises(RuntimeError), transaction.atomic():
        app.tasks["dj.notify"].delay_on_commit("o-2")
        raise RuntimeError("rolled back")
    assert jobs(store) == []


def test_an_idempotency_key_publishes_once_from_on_commit(app, transaction):
    app, store = app
    notify = app.tasks["dj.notify"]
    with transaction.atomic():
        notify.apply_async_on_commit(("o-3",), idempotency_key="order-3:notify")
        notify.apply_async_on_commit(("o-3",), idempotency_key="order-3:notify")
    assert jobs(store) == [("dj.notify", "order-3:notify")]


def test_any_task_class_composes_with_lease_task():
    from celery import Task

    from celery_lease.django import lease_task_class

    class Audited(Task):
        audited = True

    composed = lease_task_class(Audited)
    assert issubclass(composed, LeaseTask) and issubclass(composed, Audited)
    assert composed.__mro__.index(LeaseTask) < composed.__mro__.index(Audited)
    assert lease_task_class(composed) is composed


def test_without_djangos_task_class_the_import_says_which_celery_is_needed(monkeypatch):
    import celery_lease.django as composed

    monkeypatch.delitem(composed.__dict__, "LeaseDjangoTask", raising=False)
    monkeypatch.setitem(sys.modules, "celery.contrib.django.task", None)  # as on Celery 5.3
    with pytest.raises(ImportError, match=r"needs Celery >= 5\.4"):
        composed.LeaseDjangoTask  # noqa: B018 - the attribute access is the import
