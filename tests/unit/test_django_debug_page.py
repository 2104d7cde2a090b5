"""Django's DEBUG error page shows no store password, for a real store error raised in psycopg.

The store URL names a database that does not exist on the PostgreSQL server, so the connection
fails inside the driver, whose frames hold the password (the conninfo string, the connect
arguments) beside the setting itself. Django's settings are process-wide, so the project runs
in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers import with_password

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("django")

SCRIPT = r"""
import json, sys
from django.conf import settings

settings.configure(
    DEBUG=True, SECRET_KEY="tests-only", USE_TZ=True, INSTALLED_APPS=["celery_lease.contrib.django"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    CELERY_BROKER_URL="memory://", CELERY_LEASE_STORE_URL=sys.argv[1], CELERY_LEASE_TABLE_PREFIX="dbg_",
)
import django

django.setup()
from celery import Celery
from django.views.debug import ExceptionReporter

from celery_lease import LeaseTask

app = Celery("dbg")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(base=LeaseTask, name="dbg.work")
def work():
    pass


try:
    work.delay()  # a view that enqueues: the store connection fails in psycopg
except Exception as exc:
    reporter = ExceptionReporter(None, type(exc), exc, exc.__traceback__)
    print(json.dumps({"error": type(exc).__name__, "html": reporter.get_traceback_html(),
                      "text": reporter.get_traceback_text()}))
"""


def test_the_debug_page_of_a_store_error_in_psycopg_shows_no_password(postgres_url):
    url, password = with_password(postgres_url, "pw-on-the-page")
    missing = url.rsplit("/", 1)[0] + "/celery_lease_no_such_db"
    out = subprocess.run([sys.executable, "-c", SCRIPT, missing], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    page = json.loads(out.stdout.strip().splitlines()[-1])
    html, text = page["html"], page["text"]
    # The page is the store error's, with psycopg's frames and their variables on it ...
    assert page["error"] == "StoreUnavailable"
    assert "psycopg/connection.py" in html and "conninfo" in html and "celery_lease_no_such_db" in html
    assert "CELERY_LEASE_STORE_URL" in html and urlsplit(url).hostname in html
    # ... and the password is nowhere on it.
    assert password not in html and password not in text
