"""No store password leaves celery_lease: not in an exception, a log record, CLI output or a worker's log.

Bad store URLs that carry a password go through every entry point: config load, Store(), the
CLI commands and a worker start.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from celery import Celery
from celery.bin.celery import celery
from click.testing import CliRunner

from celery_lease.config import load
from celery_lease.errors import LeaseError
from celery_lease.masking import mask_secrets
from celery_lease.store import Store, for_app

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t"
BAD_URLS = [
    "postgresql+psycopg://u:s3cr3t@host.invalid/db",  # parses; the host does not resolve
    "nosuchdriver://u:s3cr3t@h/db",  # no such dialect
    "postgresql+psycopg://u:s3cr3t@h:notaport/db",  # does not parse
    "postgresql+psycopg:/u:s3cr3t@h/db",  # one slash: not a URL at all
    "postgresql+psycopg://u@host.invalid/db?sslmode=disable&password=s3cr3t",  # in the query string
]


def everything(exc: BaseException) -> str:
    """An exception's whole story: its text, repr, attributes and every chained exception."""
    return "".join(traceback.format_exception(exc)) + repr(exc) + repr(getattr(exc, "__dict__", {}))


@pytest.mark.parametrize("text", [
    "postgresql+psycopg://u:s3cr3t@host/db", "x mysql+pymysql://root:s3cr3t@h:3306/db y",
    "'redis://:s3cr3t@h:6379/0'", "postgresql://u:s3@cr/3t@h/db", "u:s3cr3t@h/db",
])
def test_mask_secrets_hides_the_password_of_any_url_in_a_text(text):
    masked = mask_secrets(text)
    assert "s3cr3t" not in masked and "cr/3t" not in masked and "***" in masked


@pytest.mark.parametrize("text", [
    "postgresql+psycopg://u@h/db?password=s3cr3t", "mysql+pymysql://h/db?charset=utf8mb4&password=s3cr3t",
    "postgresql://u@h/db?sslmode=verify-full&sslpassword=s3cr3t&connect_timeout=3",
    "sqs://h?aws_secret_access_key=s3cr3t#x", "x 'redis://h/0?Auth_Token=s3cr3t' y",
    "postgresql://u:s3cr3t@h/db?password=s3cr3t",
])
def test_mask_secrets_hides_a_secret_in_a_url_query_string(text):
    masked = mask_secrets(text)
    assert "s3cr3t" not in masked and "=***" in masked
    assert masked.split("***")[-1] == text.split("s3cr3t")[-1]  # the rest of the URL is kept


def test_a_stores_shown_url_masks_a_password_in_its_query():
    store = Store("postgresql+psycopg://u@h/db?sslmode=require&password=s3cr3t")
    assert store.safe_url == "postgresql+psycopg://u@h/db?password=***&sslmode=require"


def test_mask_secrets_leaves_text_without_passwords_alone():
    for text in ("postgresql://u@h/db", "sqlite:///tmp/x.sqlite3", "at 10:30 the lease expired"):
        assert mask_secrets(text) == text


def test_the_operator_an_audit_event_names_is_shown_whole():
    for text in ("cli:root@vm", "manual_requeue  abandoned-2  cli:ops@host-1  70a0808b",
                 "Audited as web:alice@127.0.0.1", "(admin:bob@10.0.0.7)"):
        assert mask_secrets(text) == text
    assert mask_secrets("cli:root@vm redis://u:s3cr3t@h/0") == "cli:root@vm redis://u:***@h/0"


@pytest.mark.parametrize("text", [
    "mysql+pymysql://admin:s3cr3t@db.example/lease", "postgresql://web:s3cr3t@db/x", "redis://cli:s3cr3t@r:6379/0",
    "lease_store_url='admin:s3cr3t@db'", "admin:s3cr3t@db/lease", "x=admin:s3cr3t@db",
])
def test_a_password_of_a_user_named_like_an_audit_operator_is_still_masked(text):
    assert "s3cr3t" not in mask_secrets(text)


@pytest.mark.parametrize("url", BAD_URLS)
def test_config_load_and_store_never_show_the_password(url, caplog):
    caplog.set_level(logging.DEBUG)
    load({"lease_store_url": url})  # any non-empty text passes the setting's own rule
    with pytest.raises(LeaseError) as info:
        store = Store(url, call_timeout=5.0)
        store.ensure_schema()
    assert SECRET not in everything(info.value)
    assert SECRET not in caplog.text


def test_a_setting_error_masks_the_value_it_names():
    from celery_lease.errors import LeaseConfigError

    error = LeaseConfigError("lease_store_url", "postgresql://u:s3cr3t@h/db", "is wrong")
    assert SECRET not in str(error) and SECRET not in repr(error.value)


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("args", [("status",), ("migrate",), ("check",), ("reap", "--dry-run"),
                                  ("jobs", "--json"), ("requeue", "--expired", "--dry-run")])
def test_cli_commands_never_show_the_password(url, args, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OPS_STORE", url)
    monkeypatch.setenv("OPS_PREFIX", "mask_")
    monkeypatch.setenv("OPS_BROKER", "memory://")
    monkeypatch.setattr("tests.apps.ops_app._apps", {})
    result = CliRunner().invoke(celery, ["-A", "tests.apps.ops_app", "lease", *args])
    assert result.exit_code != 0 or args[0] == "check"
    assert SECRET not in result.stdout + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit) or SECRET not in everything(
        result.exception)
    assert SECRET not in caplog.text


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_worker_start_never_shows_the_password(url, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPS_STORE": url, "OPS_PREFIX": "mask_",
           "OPS_BROKER": "memory://"}
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.ops_app", "worker", "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "DEBUG"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "lease_store_url" in output or "lease store" in output
    assert SECRET not in output


def test_an_app_whose_store_url_is_bad_fails_with_the_url_masked():
    app = Celery("mask", set_as_current=False)
    app.conf.lease_store_url = "nosuchdriver://u:s3cr3t@h/db"
    with pytest.raises(LeaseError) as info:
        for_app(app)
    assert "nosuchdriver://u:***@h/db" in str(info.value)


def test_a_conninfo_password_is_masked_bare_or_quoted():
    assert mask_secrets("host=h dbname=d user=u password=s3cr3t port=5432") == \
        "host=h dbname=d user=u password=*** port=5432"
    assert mask_secrets("password='s3 cr\\'3t' host=h sslpassword=s3cr3t") == \
        "password=*** host=h sslpassword=***"
