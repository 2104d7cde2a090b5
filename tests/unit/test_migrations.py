"""celery_lease.store.migrations and migrating: revisions, recognition, the window, --sql."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

from celery_lease.errors import LeaseConfigError, SchemaMismatch
from celery_lease.store import ClaimTerms, Store, migrations
from tests.conftest import drop_store_tables, unique_prefix
from tests.fixtures import first_release_schema

FIRST_TABLES = ("jobs", "events", "workers", "effects", "locks")


def schema_of(engine: sa.Engine, prefix: str) -> dict:
    """Every table under ``prefix`` as the database reports it, with the prefix taken out."""
    inspector = sa.inspect(engine)
    shape = {}
    for name in sorted(n for n in inspector.get_table_names() if n.startswith(prefix)):
        if name.endswith("alembic_version"):
            continue
        columns = {c["name"]: (str(c["type"]), c["nullable"]) for c in inspector.get_columns(name)}
        indexes = {ix["name"][len(prefix):]: (tuple(ix["column_names"]), bool(ix["unique"]))
                   for ix in inspector.get_indexes(name)}
        uniques = {u["name"][len(prefix):] if u["name"] else None: tuple(u["column_names"])
                   for u in inspector.get_unique_constraints(name)}
        primary = tuple(inspector.get_pk_constraint(name)["constrained_columns"])
        checks = {(c["name"] or "")[len(prefix):]: " ".join(c["sqltext"].split())
                  for c in inspector.get_check_constraints(name)}
        shape[name[len(prefix):]] = {"columns": columns, "indexes": indexes, "uniques": uniques,
                                     "primary": primary, "checks": checks}
    return shape


@pytest.fixture
def first_release_store(store_url):
    """A store made the way celery_lease 0.1 made it, filled with a job of each kind."""
    prefix = unique_prefix()
    engine = sa.create_engine(store_url)
    t = first_release_schema.tables(prefix)
    first_release_schema.migrate(engine, t)
    with engine.begin() as c:
        for i, status in enumerate(("pending", "running", "completed", "failed")):
            c.execute(sa.insert(t.jobs).values(
                id=f"job-{i}", queue_name="celery", task_name="shop.pay", payload='{"args": [1]}',
                status=status, attempt_count=i, expired_count=0, dispatch_count=1, max_attempts=5,
                available_at=100.5 + i, created_at=100.0 + i, updated_at=101.25 + i,
                idempotency_key=f"order-{i}" if i % 2 else None,
                lock_token="tok" if status == "running" else None, checkpoint='{"step": 2}',
                last_error="ValueError: x" if status == "failed" else None,
            ))
            c.execute(sa.insert(t.events).values(job_id=f"job-{i}", event="published", at=100.0 + i,
                                                 detail='{"queue": "celery"}'))
        c.execute(sa.insert(t.workers).values(worker_id="w@h:1", hostname="w@h", pid=1, started_at=1.0,
                                              last_seen_at=2.0))
        c.execute(sa.insert(t.effects).values(key="payment-captured:1", job_id="job-2", at=102.0))
        c.execute(sa.insert(t.locks).values(resource="account:7", token="lt", job_id="job-1", owner="w@h:1",
                                            expires_at=200.0))
    yield engine, prefix, t
    drop_store_tables(engine, prefix)
    engine.dispose()


def rows_of(engine: sa.Engine, t) -> dict:
    """The first release's columns of every row of its tables, ordered."""
    out = {}
    with engine.connect() as c:
        for table in t.metadata.sorted_tables:
            pk = list(table.primary_key.columns)
            out[table.name] = [tuple(r) for r in c.execute(sa.select(*table.columns).order_by(*pk))]
    return out


def test_revisions_are_a_single_line_starting_with_the_first_release():
    assert migrations.revisions()[0] == migrations.FIRST == "0001"
    assert len(set(migrations.revisions())) == len(migrations.revisions())
    assert migrations.supported() == migrations.revisions()[-2:]


def test_first_release_store_is_stamped_and_upgraded_with_every_row_kept(first_release_store):
    engine, prefix, t = first_release_store
    before = rows_of(engine, t)
    store = Store(str(engine.url.render_as_string(hide_password=False)), prefix)

    done = store.migrate()

    assert done[-2:] == ["recognised the first release's tables and stamped them as revision 0001",
                         f"upgraded revision 0001 -> {migrations.head()}"]
    assert rows_of(engine, t) == before
    with store.begin() as c:
        keys = c.execute(sa.select(store.t.idempotency_keys.c.key, store.t.idempotency_keys.c.job_id)
                         .order_by(store.t.idempotency_keys.c.key)).all()
        policies = c.execute(sa.select(store.t.jobs.c.on_expired)).scalars().all()
    assert [tuple(k) for k in keys] == [("order-1", "job-1"), ("order-3", "job-3")]
    assert policies == [None] * 4  # rows recorded before the policy columns: app settings apply


def test_downgrade_to_the_first_release_and_upgrade_again_keeps_every_row(first_release_store):
    engine, prefix, t = first_release_store
    before, shape = rows_of(engine, t), schema_of(engine, prefix)
    store = Store(str(engine.url.render_as_string(hide_password=False)), prefix)
    store.migrate()

    assert store.migrate(to="0001") == [f"downgraded revision {migrations.head()} -> 0001"]
    assert rows_of(engine, t) == before
    assert schema_of(engine, prefix) == shape

    assert store.migrate() == [f"upgraded revision 0001 -> {migrations.head()}"]
    assert rows_of(engine, t) == before


def test_upgrading_through_every_revision_gives_the_newest_tables(store_factory):
    stepwise, fresh = store_factory(migrate=False), store_factory(migrate=False)
    stepwise.migrate(to=migrations.FIRST)
    for revision in migrations.revisions()[1:]:
        stepwise.migrate(to=revision)

    fresh.migrate()

    assert schema_of(stepwise.engine, stepwise.prefix) == schema_of(fresh.engine, fresh.prefix)
    assert set(schema_of(fresh.engine, fresh.prefix)) == {t.name[len(fresh.prefix):]
                                                          for t in fresh.t.metadata.sorted_tables}


def test_migrate_sql_applied_by_hand_gives_the_same_schema(store_factory, store_url):
    by_hand, fresh = store_factory(migrate=False), store_factory(migrate=False)
    fresh.migrate()
    collation = fresh.dialect.key_collation()  # fresh has connected: MySQL told from MariaDB
    script = migrations.sql(store_url, by_hand.prefix, "head", key_collation=collation)

    raw = by_hand.engine.raw_connection()
    try:
        cursor = raw.cursor()
        for statement in script.split(";\n"):
            body = "\n".join(line for line in statement.splitlines() if not line.startswith("--")).strip()
            if body and body.upper() not in ("BEGIN", "COMMIT", "START TRANSACTION"):
                cursor.execute(body)
        raw.commit()
    finally:
        raw.close()

    assert schema_of(by_hand.engine, by_hand.prefix) == schema_of(fresh.engine, fresh.prefix)
    assert by_hand.ensure_schema() == migrations.head()


def test_worker_start_creates_an_empty_store_at_the_newest_revision(store_factory):
    store = store_factory(migrate=False)

    assert store.ensure_schema(create=True) == migrations.head()

    with store.begin() as c:
        assert migrations.current(c, store.prefix) == migrations.head()


def test_a_worker_start_against_a_current_store_logs_nothing_from_alembic(store_factory, caplog):
    """Reading the revision is not a migration: alembic's INFO lines would repeat at every worker start.
    An app that sets alembic's level itself still gets them."""
    store = store_factory()
    alembic = logging.getLogger("alembic.runtime.migration")
    with caplog.at_level(logging.INFO, logger="alembic"):
        store.ensure_schema(create=True)
        assert [r.getMessage() for r in caplog.records if r.name.startswith("alembic")] == []
        alembic.setLevel(logging.INFO)
        try:
            with store.begin() as c:
                assert migrations.current(c, store.prefix) == migrations.head()
        finally:
            alembic.setLevel(logging.NOTSET)
    assert any(r.name == alembic.name for r in caplog.records)
    assert alembic.level == logging.NOTSET


def test_a_publisher_never_creates_tables(store_factory):
    store = store_factory(migrate=False)

    with pytest.raises(SchemaMismatch, match=r"has no celery_lease tables .*lease migrate"):
        store.ensure_schema()

    assert not [n for n in sa.inspect(store.engine).get_table_names() if n.startswith(store.prefix)]


def test_an_old_schema_is_refused_and_left_as_it_is(first_release_store):
    engine, prefix, _ = first_release_store
    store = Store(str(engine.url.render_as_string(hide_password=False)), prefix)
    shape = schema_of(engine, prefix)

    with pytest.raises(SchemaMismatch) as caught:
        store.ensure_schema(create=True)

    oldest, newest = migrations.supported()
    message = str(caught.value)
    assert "first release's schema (0001)" in message
    assert f"runs against revisions {oldest} to {newest}" in message
    assert "celery -A proj lease migrate" in message
    assert "\n" not in message
    assert schema_of(engine, prefix) == shape
    assert f"{prefix}alembic_version" not in sa.inspect(engine).get_table_names()


def test_the_previous_revision_is_accepted(store_factory):
    oldest, _ = migrations.supported()
    store = store_factory(migrate=False)
    store.migrate(to=oldest)

    assert Store(store.url, store.prefix).ensure_schema() == oldest


def test_an_unknown_newer_revision_asks_for_a_newer_celery_lease(store):
    with store.begin() as c:
        c.execute(sa.text(f"UPDATE {store.prefix}alembic_version SET version_num = '9999'"))

    with pytest.raises(SchemaMismatch, match=r"revision 9999.*upgrade celery_lease on this host"):
        Store(store.url, store.prefix).ensure_schema()


def test_migrate_to_an_unknown_revision_names_the_known_ones(store):
    with pytest.raises(LeaseConfigError, match=r"--to='0042' is invalid.*Revisions: 0001, 0002"):
        store.migrate(to="0042")


def test_version_table_carries_the_prefix(store):
    tables = sa.inspect(store.engine).get_table_names()
    assert f"{store.prefix}alembic_version" in tables


def test_drop_schema_removes_every_table_of_the_store_and_only_those(store_factory):
    mine, other = store_factory(), store_factory()

    dropped = mine.drop_schema()

    assert f"{mine.prefix}alembic_version" in dropped and f"{mine.prefix}jobs" in dropped
    names = sa.inspect(mine.engine).get_table_names()
    assert not [n for n in names if n.startswith(mine.prefix)]
    assert f"{other.prefix}jobs" in names


def test_drop_schema_leaves_an_application_table_that_shares_the_prefix(store_factory):
    store = store_factory(reuse=False)
    order = sa.Table(f"{store.prefix}order", sa.MetaData(),
                     sa.Column("id", sa.Integer, primary_key=True, autoincrement=False))
    with store.engine.begin() as c:
        order.create(c)
        c.execute(order.insert().values(id=1))
    try:
        dropped = store.drop_schema()

        assert f"{store.prefix}jobs" in dropped and order.name not in dropped
        assert [n for n in sa.inspect(store.engine).get_table_names() if n.startswith(store.prefix)] == [
            order.name]
        with store.engine.begin() as c:
            assert c.execute(sa.select(order.c.id)).scalars().all() == [1]
    finally:
        order.drop(store.engine, checkfirst=True)


def test_migrate_without_downgrade_only_ever_upgrades(store_factory):
    from celery_lease.store import migrating

    store = store_factory(migrate=False)
    store.migrate(to="0003")

    assert migrating.migrate(store, "0005", downgrade=False) == ["upgraded revision 0003 -> 0005"]
    assert migrating.migrate(store, "0002", downgrade=False) == []
    assert migrating.describe(store) == ("0005", True)


def test_a_worker_refuses_to_start_against_an_old_schema(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    Store(url, "core_").migrate(to="0001")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "CORE_STORE": url, "CORE_PREFIX": "core_",
           "CORE_BROKER": "redis://127.0.0.1:6379/4"}  # never reached: the worker stops first

    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.core_app", "worker", "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)

    assert result.returncode != 0
    oldest, newest = migrations.supported()
    output = result.stdout + result.stderr
    assert "is at revision 0001; celery_lease" in output, output[-2000:]
    assert f"runs against revisions {oldest} to {newest}: run `celery -A proj lease migrate`" in output
    assert Store(url, "core_").schema_state() == ("0001", True)  # nothing upgraded behind our back


TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=3, takeover=False)


@pytest.fixture
def mysql_store(mysql_url):
    """A store of its own on MySQL/MariaDB, not yet migrated, dropped afterwards."""
    store = Store(mysql_url, unique_prefix())
    yield store
    store.drop_schema()
    store.engine.dispose()


def every_row(store) -> dict:
    """Every row of every table of the store, as text, ordered."""
    with store.begin() as c:
        return {table.name: sorted(tuple(map(str, row)) for row in c.execute(sa.select(table)))
                for table in store.t.metadata.sorted_tables}


def test_upgrading_a_mysql_store_from_0008_keeps_its_rows_and_then_tells_apart_ids_differing_by_case_or_space(
        mysql_store):
    store = mysql_store
    store.migrate(to="0008")
    store.publishes.record("Order-42", "t", "celery", "{}", 5, idempotency_key="order-7")
    store.publishes.record("job-7", "t", "celery", "{}", 5)
    assert store.jobs.claim("job-7", "w", "tok", TERMS, "t", "celery", lambda: None).claimed
    assert store.effects.record_effect("k", "job-7", "tok", "w").name == "FIRST"
    before = every_row(store)

    assert store.migrate() == ["upgraded revision 0008 -> 0009"]

    assert every_row(store) == before
    assert store.publishes.record("order-42", "t", "celery", "{}", 5) == (True, "order-42")
    assert store.publishes.record("job-7 ", "t", "celery", "{}", 5) == (True, "job-7 ")
    assert store.publishes.record("p", "t", "celery", "{}", 5, idempotency_key="order-7 ") == (True, "p")
    claim = store.jobs.claim("order-42", "w", "tok2", TERMS, "t", "celery", lambda: None)
    assert (claim.claimed, claim.job.id) == (True, "order-42")
    assert store.effects.record_effect("k ", "job-7", "tok", "w").name == "FIRST"


def test_going_back_to_0008_refuses_while_two_ids_would_become_one_and_names_them(mysql_store):
    store = mysql_store
    store.migrate()
    for job_id in ("Order-42", "order-42", "job-1"):
        store.publishes.record(job_id, "t", "celery", "{}", 5)

    with pytest.raises(SchemaMismatch, match=r"jobs\.id 'Order-42' and 'order-42'.*delete or rename one"):
        store.migrate(to="0008")

    assert store.schema_state() == (migrations.head(), True)
    with store.begin() as c:
        c.execute(sa.delete(store.t.jobs).where(store.t.jobs.c.id == "order-42"))
    assert store.migrate(to="0008") == [f"downgraded revision {migrations.head()} -> 0008"]
    with store.begin() as c:
        assert sorted(c.execute(sa.select(store.t.jobs.c.id)).scalars()) == ["Order-42", "job-1"]
