"""LeaseTask composed with Django's DjangoTask: delay_on_commit and apply_async_on_commit record
and publish once the transaction commits, and an idempotency key still publishes once."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery import Celery, group

from celery_lease import LeaseTask
from tests.conftest import drop_app_store, migrated_store, service_url, unique_prefix
from tests.helpers import wait_for

django = pytest.importorskip("django")
# DjangoTask exists from Celery 5.4; the floor-versions run has 5.3, where only the refusal applies.
HAS_DJANGO_TASK = importlib.util.find_spec("celery.contrib.django") is not None


# Django's settings are process-wide: one configuration for the module, three databases, each
# also the lease store of the tests on it (the SQLite file, PostgreSQL's and MariaDB's `test`).
SQLITE_DIR = tempfile.mkdtemp(prefix="celery_lease_django_")
atexit.register(shutil.rmtree, SQLITE_DIR, True)
SQLITE_FILE = Path(SQLITE_DIR) / "db.sqlite3"
MODEL_TABLE = f"{unique_prefix()}order"


def _server_database(service: str, engine: str, port: int) -> dict:
    url = urlsplit(service_url(service))
    return {"ENGINE": f"django.db.backends.{engine}", "NAME": url.path.lstrip("/"), "USER": url.username,
            "PASSWORD": url.password or "", "HOST": url.hostname, "PORT": str(url.port or port)}


@pytest.fixture(scope="module")
def transaction():
    from django.conf import settings

    if not settings.configured:
        databases = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(SQLITE_FILE),
                                 "OPTIONS": {"timeout": 30}},
                     "postgres": _server_database("postgres", "postgresql", 5432),
                     "mysql": _server_database("mysql", "mysql", 3306)}
        with contextlib.suppress(ImportError):
            import pymysql

            pymysql.install_as_MySQLdb()  # Django's MySQL backend on PyMySQL where mysqlclient is absent
        settings.configure(DATABASES=databases, INSTALLED_APPS=[], USE_TZ=True)
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


# -- effects in Django's transaction ------------------------------------------------------
@pytest.fixture(scope="module")
def order_model(transaction):
    from django.db import models

    class Order(models.Model):
        number = models.CharField(max_length=40)

        class Meta:
            app_label = "celery_lease_tests"
            db_table = MODEL_TABLE

    return Order


@pytest.fixture(params=["default", "postgres", "mysql"], ids=["sqlite", "postgres", "mysql"])
def orm(request, order_model, redis_url):
    """An app whose lease store is the Django database ``alias`` (the Order table beside it)."""
    from django.db import connections

    alias = request.param
    if alias == "mysql":
        import pymysql  # posing as mysqlclient for Django (the transaction fixture installs it)

        if tuple(pymysql.version_info[:3]) < (1, 4, 3):
            pytest.skip(f"PyMySQL {pymysql.__version__} poses as mysqlclient {pymysql.version_info[:3]}, "
                        "below the 1.4.3 Django's MySQL backend requires (PyMySQL >= 1.1)")
    store_url = f"sqlite:///{SQLITE_FILE}" if alias == "default" else request.getfixturevalue(f"{alias}_url")
    broker = urlunsplit(urlsplit(redis_url)._replace(path="/15"))
    app = Celery(f"orm_{unique_prefix()}", broker=broker, set_as_current=False)
    app.conf.update(lease_store_url=store_url, lease_table_prefix=unique_prefix(), lease_duration=5.0,
                    lease_heartbeat_interval=0.5, task_default_queue=f"orm-{unique_prefix()}",
                    worker_hijack_root_logger=False, lease_max_attempts=1,
                    # A delivery that meets a transaction holding the SQLite file comes back within seconds.
                    lease_store_retry_delay=0.5, lease_store_retry_max=2.0)
    Order = order_model

    @app.task(base=LeaseTask, bind=True, shared=False, name="orm.place")
    def place(self, number, fail=False, by_alias=False, store_own=False, written=True, atomic=True):
        from django.db import transaction

        try:
            with transaction.atomic(using=alias) if atomic else contextlib.nullcontext():
                if written:
                    Order.objects.using(alias).create(number=number)
                where = {"using": alias} if by_alias else {"connection": connections[alias]}
                if store_own:  # the key in the store's own transaction, not the ORM's
                    where = {}
                with self.lease.effect(f"order-placed:{number}", **where) as first:
                    pass
                if fail:
                    raise RuntimeError("the body fails after its effect block")
                if not written:
                    Order.objects.using(alias).create(number=number)
            return first
        finally:
            if self.request.is_eager is False:
                connections[alias].close()  # the worker thread's own connection

    store = migrated_store(app)
    with connections[alias].schema_editor() as editor:
        editor.create_model(Order)
    try:
        yield app, store, alias
    finally:
        with connections[alias].schema_editor() as editor:
            editor.delete_model(Order)
        connections[alias].close()
        drop_app_store(app)


def orders(alias, order_model, number):
    return order_model.objects.using(alias).filter(number=number).count()


def settled(store, job_id):
    job = store.get(job_id)
    return job is not None and job.status in ("completed", "failed")


def test_an_effect_on_a_django_connection_commits_with_the_orm_row_in_a_worker(orm, order_model):
    from celery.contrib.testing.worker import start_worker

    app, store, alias = orm
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["orm.place"].delay("w-1")
        wait_for(lambda: settled(store, result.id), timeout=30, message="the job did not end")
    assert store.get(result.id).status == "completed", store.get(result.id).last_error
    assert orders(alias, order_model, "w-1") == 1
    assert store.reports.effect_record("order-placed:w-1")["job_id"] == result.id


def test_a_body_failing_after_the_effect_block_leaves_no_key_and_no_row_in_a_worker(orm, order_model):
    from celery.contrib.testing.worker import start_worker

    app, store, alias = orm
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["orm.place"].delay("w-2", fail=True, by_alias=True)
        wait_for(lambda: settled(store, result.id), timeout=30, message="the job did not end")
    assert "the body fails after its effect block" in (store.get(result.id).last_error or "")
    assert orders(alias, order_model, "w-2") == 0
    assert store.reports.effect_record("order-placed:w-2") is None


def test_an_eager_effect_by_alias_commits_with_the_orm_row_and_is_first_once(orm, order_model):
    app, store, alias = orm
    place = app.tasks["orm.place"]
    assert place.apply(("e-1",), {"by_alias": True}).get() is True
    assert orders(alias, order_model, "e-1") == 1
    assert store.reports.effect_record("order-placed:e-1") is not None
    # A second eager run of the same order finds the key in the database, as a worker would.
    assert place.apply(("e-1",), {"by_alias": True}).get() is False


def test_an_eager_body_failing_after_the_effect_block_rolls_back_key_and_row(orm, order_model):
    app, store, alias = orm
    place = app.tasks["orm.place"]
    with pytest.raises(RuntimeError, match="after its effect block"):
        place.apply(("e-2",), {"fail": True}).get()
    assert orders(alias, order_model, "e-2") == 0
    assert store.reports.effect_record("order-placed:e-2") is None
    assert place.apply(("e-2",)).get() is True  # the effect was not lost


def test_an_eager_effect_on_a_django_connection_in_autocommit_is_refused_naming_the_fix(orm, order_model):
    app, store, alias = orm
    place = app.tasks["orm.place"]
    # The key would commit alone, before the block's ORM write: a crash in between loses the effect.
    with pytest.raises(ValueError, match=rf"wrap the block in transaction\.atomic\(using='{alias}'\)"):
        place.apply(("e-3",), {"by_alias": True, "atomic": False, "written": False}).get()
    assert store.reports.effect_record("order-placed:e-3") is None
    assert orders(alias, order_model, "e-3") == 0


def test_an_effect_on_a_django_connection_in_autocommit_fails_the_job_naming_the_fix_in_a_worker(
        orm, order_model):
    from celery.contrib.testing.worker import start_worker

    app, store, alias = orm
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["orm.place"].delay("w-5", atomic=False, written=False)
        wait_for(lambda: settled(store, result.id), timeout=30, message="the job did not end")
    job = store.get(result.id)
    assert job.status == "failed", job
    assert f"wrap the block in transaction.atomic(using='{alias}')" in (job.last_error or ""), job.last_error
    assert store.reports.effect_record("order-placed:w-5") is None
    assert orders(alias, order_model, "w-5") == 0


def test_base_lease_task_keeps_delay_on_commit_where_djangos_fixup_set_the_task_class(tmp_path, transaction):
    # The task class Celery's Django fixup gives an app; base=LeaseTask replaces it for this task.
    app = Celery(f"fixup_{unique_prefix()}", broker="memory://", set_as_current=False,
                 task_cls="celery.contrib.django.task:DjangoTask" if HAS_DJANGO_TASK else None)
    app.conf.update(lease_store_url=f"sqlite:///{tmp_path}/store.db", lease_table_prefix=unique_prefix())

    @app.task(base=LeaseTask, shared=False, name="dj.ship")
    def ship(order):
        return order

    store = migrated_store(app)
    try:
        assert callable(getattr(ship, "delay_on_commit", None)), "base=LeaseTask dropped delay_on_commit"
        with transaction.atomic():
            ship.delay_on_commit("o-4")
            ship.apply_async_on_commit(("o-5",), idempotency_key="order-5:ship")
            assert jobs(store) == []
        assert set(jobs(store)) == {("dj.ship", None), ("dj.ship", "order-5:ship")}
        with pytest.raises(RuntimeError), transaction.atomic():
            ship.delay_on_commit("o-6")
            raise RuntimeError("rolled back")
        assert len(jobs(store)) == 2
    finally:
        drop_app_store(app)


def test_an_effect_in_the_stores_own_transaction_inside_an_atomic_block_holding_its_sqlite_file_is_refused(
        orm, order_model):
    from celery.contrib.testing.worker import start_worker

    app, store, alias = orm
    if alias != "default":
        pytest.skip("only a SQLite file has one writer: a server database locks rows, not the store's tables")
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = app.tasks["orm.place"].delay("w-3", store_own=True)
        wait_for(lambda: settled(store, result.id), timeout=30, message="the job did not end")
        # Before the block writes, it holds nothing: the key commits on the store's own connection.
        first = app.tasks["orm.place"].delay("w-4", store_own=True, written=False)
        wait_for(lambda: settled(store, first.id), timeout=30, message="the job did not end")
    job = store.get(result.id)
    assert job.status == "failed" and "using=<alias>" in (job.last_error or ""), job.last_error
    assert job.attempt_count == 1 and orders(alias, order_model, "w-3") == 0
    assert store.get(first.id).status == "completed" and orders(alias, order_model, "w-4") == 1


def test_a_publish_inside_an_atomic_block_holding_the_sqlite_file_the_store_shares_is_sent_and_runs(
        orm, order_model):
    from celery.contrib.testing.worker import start_worker
    from django.db import transaction

    from celery_lease.errors import StoreRejected
    from celery_lease.vocabulary import StoreFailure

    app, store, alias = orm
    if alias != "default":
        pytest.skip("only a SQLite file has one writer: a server database locks rows, not the store's tables")
    place = app.tasks["orm.place"]
    with transaction.atomic(using=alias):
        order_model.objects.using(alias).create(number="a-0")  # the file's write lock is this thread's
        # Plain Celery sends it: so does the lease, unrecorded (its claim records it), not waiting on
        # itself
        result = place.delay("a-1")
        members = group(place.s("a-3"), place.s("a-4")).delay()  # a group too, not batched on the lock
        # A key needs its record: a clear refusal naming the fix, not an outage
        with pytest.raises(StoreRejected, match="apply_async_on_commit") as refused:
            place.apply_async(("a-2",), idempotency_key="order-a-2")
        assert refused.value.kind == StoreFailure.LOCKED_BY_CALLER
    jobs = [result.id, *(member.id for member in members.results)]
    assert [store.get(job_id) for job_id in jobs] == [None] * 3  # sent, not recorded
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        wait_for(lambda: all(settled(store, job_id) for job_id in jobs), timeout=60,
                 message="a job sent unrecorded never ran")
    assert [store.get(job_id).status for job_id in jobs] == ["completed"] * 3
    assert [orders(alias, order_model, number) for number in ("a-1", "a-3", "a-4")] == [1, 1, 1]
