"""celery_lease.contrib.django's migrations: one per store revision, and ``manage.py migrate`` runs them.

``migrate`` runs in a child process on the tiny project under tests/django_project (Django's
settings are process-wide), its database a SQLite file or a PostgreSQL database of its own, and
the store following it (``CELERY_LEASE_DATABASE``); the store's own version table is read here.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import pkgutil
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from celery_lease.store import Store, migrating
from celery_lease.store import migrations as store_migrations
from tests.conftest import unique_prefix

pytest.importorskip("django")

ROOT = Path(__file__).resolve().parents[2]
PREFIX = unique_prefix()


def django_migrations() -> list:
    from celery_lease.contrib.django import migrations as package

    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def test_the_app_has_one_migration_per_store_revision_in_order():
    modules = django_migrations()
    assert [m.revision for m in modules] == list(store_migrations.revisions())
    store_files = sorted(p.stem for p in (Path(store_migrations.__file__).parent / "versions").glob("0*.py"))
    assert [m.__name__.rsplit(".", 1)[1] for m in modules] == store_files
    for previous, module in itertools.pairwise(modules):
        assert module.Migration.dependencies == [("celery_lease", previous.__name__.rsplit(".", 1)[1])]


def manage(database: dict, *args: str) -> None:
    lease = {"DATABASES": {"default": database}, "CELERY_LEASE_DATABASE": "default",
             "CELERY_LEASE_TABLE_PREFIX": PREFIX}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(lease)}
    command = [sys.executable, "-m", "django", *args, "--settings", "tests.django_project.settings"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr


def revision(url: str) -> str | None:
    store = Store(url, PREFIX)
    try:
        return migrating.describe(store)[0]
    finally:
        store.dispose()


def migrate_back_and_forth(database: dict, url: str) -> None:
    older = django_migrations()[2].__name__.rsplit(".", 1)[1]
    manage(database, "migrate", "celery_lease", older)
    assert revision(url) == older[:4]
    manage(database, "migrate", "celery_lease")
    assert revision(url) == store_migrations.head()
    manage(database, "migrate", "celery_lease", "zero")
    store = Store(url, PREFIX)
    try:
        assert migrating.describe(store) == (None, False)
    finally:
        store.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def project_database(request, tmp_path):
    """(the Django DATABASES entry, the store's URL) of a database of this test's own."""
    if request.param == "sqlite":
        path = tmp_path / "db.sqlite3"
        yield {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}, f"sqlite:///{path}"
        return
    postgres_url = request.getfixturevalue("postgres_url")
    name = f"lease_dj_{uuid.uuid4().hex[:8]}"
    server = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        parts = urlsplit(postgres_url)
        yield ({"ENGINE": "django.db.backends.postgresql", "NAME": name, "USER": parts.username,
                "PASSWORD": parts.password or "", "HOST": parts.hostname, "PORT": str(parts.port or 5432)},
               sa.engine.make_url(postgres_url).set(database=name).render_as_string(hide_password=False))
    finally:
        with server.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        server.dispose()


def test_migrate_creates_an_older_revision_then_upgrades_the_store_to_head(project_database):
    migrate_back_and_forth(*project_database)


def test_migrate_leaves_a_store_a_worker_already_brought_to_head_with_its_rows(project_database):
    database, url = project_database
    # Given a store created at head by a worker start (or `lease migrate`), with a kept result
    store = Store(url, PREFIX)
    try:
        migrating.migrate(store)
        with store.begin() as c:
            c.execute(store.t.jobs.insert().values(
                id="j-1", task_name="shop.pay", status="completed", attempt_count=1, max_attempts=3,
                expired_count=0, dispatch_count=0, available_at=0, created_at=0, updated_at=0,
                result="KEPT-RESULT"))
    finally:
        store.dispose()

    # When the project runs Django's migrations (0001 first, as on a new project)
    manage(database, "migrate", "celery_lease")

    # Then no step took the store down: it stays at head and keeps its rows
    assert revision(url) == store_migrations.head()
    store = Store(url, PREFIX)
    try:
        with store.begin() as c:
            assert c.execute(sa.select(store.t.jobs.c.result)).scalars().all() == ["KEPT-RESULT"]
    finally:
        store.dispose()


def test_migrate_zero_drops_the_store_and_leaves_a_project_table_that_shares_its_prefix(tmp_path):
    path = tmp_path / "db.sqlite3"
    database, url = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}, f"sqlite:///{path}"
    manage(database, "migrate", "celery_lease")
    engine = sa.create_engine(url)
    try:
        order = sa.Table(f"{PREFIX}order", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
        with engine.begin() as c:
            order.create(c)
            c.execute(order.insert().values(id=1))

        manage(database, "migrate", "celery_lease", "zero")

        names = [n for n in sa.inspect(engine).get_table_names() if n.startswith(PREFIX)]
        assert names == [f"{PREFIX}order"]
        with engine.begin() as c:
            assert c.execute(sa.select(order.c.id)).scalars().all() == [1]
    finally:
        engine.dispose()
