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


def test_migrate_creates_an_older_revision_then_upgrades_the_store_to_head_on_sqlite(tmp_path):
    path = tmp_path / "db.sqlite3"
    migrate_back_and_forth({"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}, f"sqlite:///{path}")


def test_migrate_creates_an_older_revision_then_upgrades_the_store_to_head_on_postgresql(postgres_url):
    name = f"lease_dj_{uuid.uuid4().hex[:8]}"
    server = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        parts = urlsplit(postgres_url)
        database = {"ENGINE": "django.db.backends.postgresql", "NAME": name, "USER": parts.username,
                    "PASSWORD": parts.password or "", "HOST": parts.hostname, "PORT": str(parts.port or 5432)}
        migrate_back_and_forth(database, sa.engine.make_url(postgres_url).set(database=name)
                               .render_as_string(hide_password=False))
    finally:
        with server.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        server.dispose()
