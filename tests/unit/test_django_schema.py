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


def manage(database: dict, *args: str, **settings: object) -> subprocess.CompletedProcess:
    lease = {"DATABASES": {"default": database}, "CELERY_LEASE_DATABASE": "default",
             "CELERY_LEASE_TABLE_PREFIX": PREFIX, **settings}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(lease)}
    command = [sys.executable, "-m", "django", *args, "--settings", "tests.django_project.settings"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    return result


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


def test_migrate_creates_the_store_django_recorded_while_it_followed_another_database(project_database):
    # Given a project migrated while the store was elsewhere (on a URL): Django recorded every
    # migration of the app as applied on "default", where they did nothing
    database, url = project_database
    manage(database, "migrate", "celery_lease", CELERY_LEASE_DATABASE=None,
           CELERY_LEASE_STORE_URL="sqlite:///:memory:")
    assert describe(url) == (None, False)

    # When the store is set to follow "default" and migrate finds nothing left to apply
    result = manage(database, "migrate")

    # Then the store is there all the same, at the revision Django recorded
    assert "No migrations to apply" in result.stdout
    assert revision(url) == store_migrations.head()


def describe(url: str) -> tuple[str | None, bool]:
    store = Store(url, PREFIX)
    try:
        return migrating.describe(store)
    finally:
        store.dispose()


def test_migrate_with_this_apps_migrations_off_makes_the_store_at_the_newest_revision(tmp_path):
    # As Django's test database with TEST {"MIGRATE": False}, and pytest-django's --nomigrations, do.
    path = tmp_path / "db.sqlite3"
    database, url = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}, f"sqlite:///{path}"
    manage(database, "migrate", "--run-syncdb", MIGRATION_MODULES={"celery_lease": None})
    assert revision(url) == store_migrations.head()


def test_djangos_runner_on_a_test_database_made_without_migrations_has_the_store(tmp_path):
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:", "TEST": {"MIGRATE": False}}
    result = manage(database, "test", "tests.django_project.lease_cases", "--noinput",
                    CELERY_TASK_ALWAYS_EAGER=True, CELERY_RESULT_BACKEND="cache+memory://",
                    TEST_RUNNER="celery_lease.contrib.django.testing.LeaseTestRunner")
    assert "Ran 6 tests" in result.stderr and "\nOK" in result.stderr


def test_pytest_djangos_nomigrations_test_database_has_the_store(tmp_path):
    pytest.importorskip("pytest_django")
    project = {"DATABASES": {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
               "CELERY_LEASE_DATABASE": "default", "CELERY_TASK_ALWAYS_EAGER": True}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(project),
           "DJANGO_SETTINGS_MODULE": "tests.django_project.settings"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_django",
               "-p", "celery_lease.contrib.django.pytest_plugin", "--nomigrations",
               "--rootdir", str(tmp_path),
               str(ROOT / "tests" / "django_project" / "plugin_cases.py")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


COUNT_FLUSH_STATEMENTS = """
import json
import sqlalchemy as sa
from celery import current_app
from django.core.management import call_command
from celery_lease.store import for_app
store = for_app(current_app._get_current_object(), check=False)
engine = store.engine
statements = []
sa.event.listen(sa.engine.Engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
call_command("flush", interactive=False, verbosity=0)
print(json.dumps({"statements": statements, "kept": store.engine is engine}))
"""


def test_a_flush_of_a_store_at_the_newest_revision_costs_one_version_read_and_keeps_the_apps_store(tmp_path):
    # TransactionTestCase flushes the test database after each test; each flush of a database with tables
    # (contenttypes' here) sends post_migrate.
    path = tmp_path / "db.sqlite3"
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}
    apps = ["django.contrib.contenttypes", "celery_lease.contrib.django"]
    manage(database, "migrate", INSTALLED_APPS=apps)
    result = manage(database, "shell", "-c", COUNT_FLUSH_STATEMENTS, INSTALLED_APPS=apps)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    statements = seen["statements"]
    assert seen["kept"], "the flush disposed the app's own store (a worker in this process would lose it)"
    version_table = store_migrations.version_table(PREFIX)
    assert [s for s in statements if s != "BEGIN" and version_table not in s] == [], statements
    assert len([s for s in statements if s.startswith("SELECT")]) == 1, statements
