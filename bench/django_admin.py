"""The lease admin's change lists over a 1,000,000-row jobs table on PostgreSQL (not part of make test).

The table is bench/exporter.py's busy week (generate_series: mostly completed history, 1,000
running jobs, 5,000 pending, 2,000 dead letters; an events table as large), in a database of the
bench's own that Django's ``migrate`` creates (the store follows ``CELERY_LEASE_DATABASE``) and
that is dropped at the end. Each page is requested through Django's test client as a signed-in
superuser, the median of a few requests printed with the largest number of rows a COUNT in it
could read (the paginator's bound), next to a whole-table ``COUNT(*)`` for comparison.

Usage: python -m bench.django_admin [--rows 1000000] [--requests 5]
"""

from __future__ import annotations

import argparse
import re
import uuid

import sqlalchemy as sa

from bench._pg import bench_database
from bench.exporter import POSTGRES, fill, timed

PAGES = {
    "jobs": "/admin/celery_lease_admin/job/",
    "jobs, page 50": "/admin/celery_lease_admin/job/?p=50",
    "jobs, failed": "/admin/celery_lease_admin/job/?status__exact=failed",
    "jobs, by task": "/admin/celery_lease_admin/job/?task_name=bench.task3",
    "jobs, search by id": "/admin/celery_lease_admin/job/?q=job-4242",
    "dead letters": "/admin/celery_lease_admin/deadletter/",
    "running leases": "/admin/celery_lease_admin/runninglease/",
    "events": "/admin/celery_lease_admin/event/",
    "a job's page": "/admin/celery_lease_admin/job/job-4242/change/",
}


def configure(url: str, prefix: str) -> None:
    import django
    from django.conf import settings

    parts = sa.engine.make_url(url)
    settings.configure(
        SECRET_KEY="bench", USE_TZ=True, ROOT_URLCONF=__name__, ALLOWED_HOSTS=["testserver"],
        INSTALLED_APPS=["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                        "django.contrib.sessions", "django.contrib.messages", "celery_lease.contrib.django",
                        "celery_lease.contrib.django.admin"],
        MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                    "django.contrib.auth.middleware.AuthenticationMiddleware",
                    "django.contrib.messages.middleware.MessageMiddleware"],
        TEMPLATES=[{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
                    "OPTIONS": {"context_processors": ["django.template.context_processors.request",
                                                       "django.contrib.auth.context_processors.auth",
                                                       "django.contrib.messages.context_processors.messages"]}}],
        DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": parts.database,
                               "USER": parts.username, "PASSWORD": parts.password or "",
                               "HOST": parts.host, "PORT": str(parts.port or 5432)}},
        CELERY_BROKER_URL="memory://", CELERY_LEASE_DATABASE="default", CELERY_LEASE_TABLE_PREFIX=prefix,
    )
    from celery import Celery

    app = Celery("bench_admin")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    app.set_current()
    django.setup()


def urls() -> list:
    from django.contrib import admin
    from django.urls import path

    return [path("admin/", admin.site.urls)]


def __getattr__(name: str) -> object:  # ROOT_URLCONF = this module, its urls made once Django is set up
    if name == "urlpatterns":
        return urls()
    raise AttributeError(name)


def measure(rows: int, requests: int, verbose: bool = False) -> None:
    server = sa.engine.make_url(bench_database(POSTGRES))
    name = f"celery_lease_bench_admin_{uuid.uuid4().hex[:8]}"
    admin_engine = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin_engine.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        configure(url, "bench_")
        from celery import current_app
        from django.contrib.auth.models import User
        from django.core.management import call_command
        from django.db import connection
        from django.test import Client
        from django.test.utils import CaptureQueriesContext

        from celery_lease.store import for_app

        call_command("migrate", verbosity=0)
        store = for_app(current_app)
        fill(store, rows, history=True)
        with store.begin(long=True) as c:
            counted = c.execute(sa.select(sa.func.count()).select_from(store.t.jobs)).scalar_one()
        client = Client()
        client.force_login(User.objects.create_superuser("bench", "bench@example.com", "bench"))
        print(f"jobs table: {counted:,} rows; median of {requests} requests")

        def whole_count() -> None:
            with store.begin(long=True) as c:
                c.execute(sa.select(sa.func.count()).select_from(store.t.jobs)).scalar_one()

        print(f"  {'COUNT(*) of the whole table, for comparison':46} {timed(whole_count, 3) * 1000:8.1f} ms")
        for label, path in PAGES.items():
            response = client.get(path)
            assert response.status_code == 200, (path, response.status_code)
            with CaptureQueriesContext(connection) as queries:
                client.get(path)
            slowest = max(queries.captured_queries, key=lambda q: float(q["time"]))
            whole = [q["sql"] for q in queries.captured_queries
                     if "COUNT(" in q["sql"].upper() and not re.search(r"\bLIMIT\b", q["sql"])]
            assert not whole, whole
            count = len(queries.captured_queries)
            if verbose:
                for q in queries.captured_queries:
                    print(f"    {float(q['time']) * 1000:7.1f} ms  {q['sql'][:300]}")
            print(f"  {label:46} {timed(lambda p=path: client.get(p), requests) * 1000:8.1f} ms "
                  f"({count} queries, slowest {float(slowest['time']) * 1000:.1f} ms)")
        store.dispose()
        connection.close()
    finally:
        with admin_engine.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin_engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--queries", action="store_true", help="print each page's queries and their times")
    args = parser.parse_args()
    measure(args.rows, args.requests, args.queries)


if __name__ == "__main__":
    main()
