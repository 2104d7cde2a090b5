"""celery_lease.store.schema: the tables at the newest revision and their deterministic names."""

from __future__ import annotations

import re
import uuid

import pytest
import sqlalchemy as sa

from celery_lease import config
from celery_lease.store import ClaimTerms, schema

TABLES = ("jobs", "events", "workers", "effects", "locks", "idempotency_keys", "reaper_runs", "meta")


def prefixed_tables(engine: sa.Engine, prefix: str) -> set[str]:
    return {name for name in sa.inspect(engine).get_table_names() if name.startswith(prefix)}


def constraint_and_index_names(t: schema.Tables) -> set[str]:
    names = set()
    for table in t.metadata.sorted_tables:
        names |= {ix.name for ix in table.indexes}
        names |= {c.name for c in table.constraints if c.name is not None}
    return names


def test_tables_factory_names_every_table_with_the_prefix():
    t = schema.tables("shop_")
    assert {table.name for table in t.metadata.sorted_tables} == {f"shop_{name}" for name in TABLES}


def test_every_index_and_named_constraint_carries_the_prefix():
    names = constraint_and_index_names(schema.tables("shop_"))
    assert names, "the schema defines no named indexes or constraints"
    assert all(name.startswith("shop_") for name in names), names


def test_index_names_are_deterministic_for_a_prefix():
    assert constraint_and_index_names(schema.tables("a_")) == constraint_and_index_names(schema.tables("a_"))


def test_two_prefixes_share_no_index_name():
    # Two stores in one PostgreSQL schema must not collide on index names.
    a, b = constraint_and_index_names(schema.tables("a_")), constraint_and_index_names(schema.tables("b_"))
    assert not a & b


def longest_allowed_prefix() -> str:
    """The longest table prefix that lease_table_prefix's rule accepts."""
    rule = config.BY_NAME["lease_table_prefix"].check
    prefix = ""
    while len(prefix) < 200:
        try:
            rule(prefix + "p")
        except ValueError:
            return prefix
        prefix += "p"
    raise AssertionError("lease_table_prefix accepts prefixes of any length")


def test_index_names_fit_mysql_and_postgres_limits_with_the_longest_prefix():
    prefix = longest_allowed_prefix()
    longest = max(len(name) for name in constraint_and_index_names(schema.tables(prefix)))
    assert longest <= 63, longest  # PostgreSQL truncates at 63, MySQL refuses past 64


def test_migrate_creates_every_table_at_the_newest_revision(store_factory):
    from celery_lease.store import migrations

    store = store_factory(migrate=False)

    done = store.migrate()

    assert done == [f"created the schema at revision {migrations.head()}"]
    assert prefixed_tables(store.engine, store.prefix) == (
        {f"{store.prefix}{name}" for name in TABLES} | {f"{store.prefix}alembic_version"})


def test_migrate_creates_the_indexes_under_their_names(store):
    inspector = sa.inspect(store.engine)
    for table in store.t.metadata.sorted_tables:
        have = {ix["name"] for ix in inspector.get_indexes(table.name)}
        dialect = store.engine.dialect.name
        assert {ix.name for ix in table.indexes if schema.created_on(ix, dialect)} <= have, table.name


def test_second_migrate_does_nothing_and_keeps_rows(store):
    with store.begin() as conn:
        conn.execute(sa.insert(store.t.workers).values(
            worker_id="w1", hostname="host", pid=1, started_at=1.0, last_seen_at=2.0,
        ))

    done = store.migrate()

    assert done == []
    with store.begin() as conn:
        rows = conn.execute(sa.select(store.t.workers.c.worker_id)).scalars().all()
    assert rows == ["w1"]


def test_migrate_leaves_other_prefixes_alone(store_factory):
    first = store_factory()
    second = store_factory(migrate=False)

    assert second.migrate() != []

    assert first.migrate() == []
    assert second.migrate() == []


def test_longest_allowed_prefix_migrates_twice(store_factory):
    # Unique per run (other test runs may share the database), padded to the limit.
    prefix = f"t{uuid.uuid4().hex[:8]}_".ljust(len(longest_allowed_prefix()), "p")
    store = store_factory(prefix=prefix)
    assert store.migrate() == []


def test_the_scans_indexes_hold_one_status_where_the_database_has_partial_indexes(store):
    found = sa.inspect(store.engine).get_indexes(store.t.jobs.name)
    jobs = {ix["name"][len(store.prefix):]: ix for ix in found}
    if store.engine.dialect.name in schema.PARTIAL_INDEXES:
        assert jobs["jobs_running_lease_ix"]["column_names"] == ["lease_expires_at", "id"]
        assert jobs["jobs_pending_at_ix"]["column_names"] == ["available_at", "id"]
        assert not {"jobs_status_lease_ix", "jobs_status_available_ix"} & set(jobs)
    else:
        assert jobs["jobs_status_lease_ix"]["column_names"] == ["status", "lease_expires_at", "id"]
        assert jobs["jobs_status_available_ix"]["column_names"] == ["status", "available_at", "id"]
        assert not {"jobs_running_lease_ix", "jobs_pending_at_ix"} & set(jobs)


def _fill_and_analyze(store, open_statuses: tuple[str, ...] = ("running", "pending")) -> None:
    """Mostly finished jobs and some open ones, whose statistics the planner has."""
    with store.engine.begin() as c:
        c.execute(sa.insert(store.t.jobs), [
            {"id": f"done-{i}", "task_name": "t", "status": "completed", "attempt_count": 1,
             "max_attempts": 5, "available_at": i, "created_at": i, "updated_at": i} for i in range(300)])
        for status in open_statuses:
            c.execute(sa.insert(store.t.jobs), [
                {"id": f"{status}-{i}", "task_name": "t", "status": status, "attempt_count": 1,
                 "max_attempts": 5, "available_at": i, "created_at": i, "updated_at": i,
                 "lease_expires_at": i if status == "running" else None} for i in range(100)])
        analyze = "ANALYZE TABLE" if store.engine.dialect.name in ("mysql", "mariadb") else "ANALYZE"
        c.exec_driver_sql(f"{analyze} {store.t.jobs.name}")


def _plan(store, statement: str, params: dict) -> str:
    """The plan the database picks for a statement the store ran, table scans priced out (small table)."""
    with store.engine.connect() as c:
        if store.engine.dialect.name == "postgresql":
            # The plan PostgreSQL keeps for a statement prepared on a pooled connection (psycopg
            # prepares a statement run five times): a generic one, made without the bound values.
            names: list[str] = []
            numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m[1]) + 1}" if m[1] in names
                              else (names.append(m[1]) or f"${len(names)}"), statement)
            c.exec_driver_sql("SET enable_seqscan = off")
            c.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
            c.exec_driver_sql(f"PREPARE scan AS {numbered}")
            values = ", ".join(repr(params[n]) for n in names)
            return "\n".join(r[0] for r in c.exec_driver_sql(f"EXPLAIN EXECUTE scan({values})"))
        if store.engine.dialect.name == "sqlite":
            return "\n".join(str(r[-1]) for r in c.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params))
        return "\n".join(str(r._mapping["key"]) for r in c.exec_driver_sql(f"EXPLAIN {statement}", params))


@pytest.mark.parametrize("scan", ["expired", "dispatch"])
def test_the_reapers_scans_use_the_index_of_their_status(store, scan):
    """On PostgreSQL and SQLite, the partial index of the scan's status: the scans state their status
    in the SQL text, as a bound status could not select it in a prepared statement's plan."""
    ran: list[tuple[str, dict]] = []

    def keep(_conn, _cursor, statement, params, *_):
        if f"FROM {store.t.jobs.name}" in statement and "SELECT" in statement:
            ran.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", keep)
    try:
        with store.begin() as c:
            if scan == "expired":
                store.reaping.scan_expired(c, limit=10)
            else:
                store.reaping.scan_lost_dispatches(c, older_than=60.0, limit=10)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", keep)

    partial = store.engine.dialect.name in schema.PARTIAL_INDEXES
    _fill_and_analyze(store)
    index = {("expired", True): "jobs_running_lease_ix", ("dispatch", True): "jobs_pending_at_ix",
             ("expired", False): "jobs_status_lease_ix", ("dispatch", False): "jobs_status_available_ix"}[
        scan, partial]
    assert ran, "the scan ran no SELECT on the jobs table"
    assert f"{store.prefix}{index}" in _plan(store, *ran[-1])


def test_a_claim_takes_its_job_by_primary_key_when_the_statistics_count_no_pending_job(store, monkeypatch):
    """A backlog that arrived after the table was last analyzed: the claim must not walk the pending
    index (which holds the job id as its second column) however cheap the statistics make it look."""
    _fill_and_analyze(store, open_statuses=("running",))
    for i in range(500):
        store.publishes.record(f"backlog-{i}", "t", "celery", None, 5)
    ran: list[tuple[str, dict]] = []
    if store.engine.dialect.name == "postgresql":
        import psycopg  # the hot statements run on the driver's cursor, under SQLAlchemy's events

        execute = psycopg.Cursor.execute

        def keep(cursor, query, params=None, **kw):
            ran.append((str(query), params))
            return execute(cursor, query, params, **kw)

        monkeypatch.setattr(psycopg.Cursor, "execute", keep)
    elif store.engine.dialect.name == "sqlite":
        # SQLite's hot statements run on the driver's cursor too: its trace has them with their
        # values in place.
        traced = []

        def trace(dbapi_conn, _record, _proxy):
            traced.append(dbapi_conn)
            dbapi_conn.set_trace_callback(lambda statement: ran.append((statement, None)))

        sa.event.listen(store.engine, "checkout", trace)
    else:
        sa.event.listen(store.engine, "before_cursor_execute",
                        lambda _c, _cu, statement, params, *_: ran.append((statement, params)))
    terms = ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=3, takeover=False)
    assert store.jobs.claim("backlog-250", "w", "tok", terms, task_name="t", queue="celery",
                            payload=lambda: None).claimed
    monkeypatch.undo()
    if store.engine.dialect.name == "sqlite":
        sa.event.remove(store.engine, "checkout", trace)
        for dbapi_conn in traced:
            dbapi_conn.set_trace_callback(None)
    statement, params = next((s, p) for s, p in ran if s.lstrip().upper().startswith(("UPDATE", "WITH")))
    name = store.engine.dialect.name
    with store.engine.connect() as c:
        if name == "postgresql":
            with c.begin():  # EXPLAIN plans the UPDATE without running it
                plan = "\n".join(r[0] for r in c.exec_driver_sql(f"EXPLAIN {statement}", params))
            assert f"Index Scan using {store.prefix}jobs_pkey on {store.t.jobs.name} " in plan, plan
        elif name == "sqlite":
            plan = "\n".join(str(r[-1]) for r in c.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params))
            assert "(id=?)" in plan, plan
        else:
            rows = c.exec_driver_sql(f"EXPLAIN {statement}", params)
            plan = "\n".join(str(r._mapping["key"]) for r in rows)
            assert plan.splitlines()[0] == "PRIMARY", plan
    assert not [ix for ix in ("pending_at_ix", "status_available_ix", "status_updated_ix") if ix in plan], \
        plan


TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=3, takeover=False)
# Pairs MySQL/MariaDB's default collation makes one (case, accents, trailing spaces); utf8mb4_bin the last.
LOOKALIKE_IDS = [("Order-42", "order-42"), ("café-1", "cafe-1"), ("job-7", "job-7 ")]


@pytest.mark.parametrize(("first", "second"), LOOKALIKE_IDS, ids=["case", "accent", "trailing-space"])
def test_job_ids_differing_only_by_case_accent_or_trailing_space_are_two_claimable_jobs(store, first, second):
    assert store.publishes.record(first, "t", "celery", "{}", 5) == (True, first)
    assert store.publishes.record(second, "t", "celery", "{}", 5) == (True, second)

    claims = [store.jobs.claim(job_id, f"w{i}", f"tok{i}", TERMS, "t", "celery", lambda: None)
              for i, job_id in enumerate((first, second))]

    assert [(c.claimed, c.job.id) for c in claims] == [(True, first), (True, second)]


def test_effect_keys_differing_only_by_a_trailing_space_are_two_effects(store):
    store.publishes.record("j1", "t", "celery", "{}", 5)
    assert store.jobs.claim("j1", "w", "tok", TERMS, "t", "celery", lambda: None).claimed

    outcomes = [store.effects.record_effect(key, "j1", "tok", "w") for key in ("k", "k ", "K")]

    assert [o.name for o in outcomes] == ["FIRST", "FIRST", "FIRST"]


def test_idempotency_keys_differing_only_by_a_trailing_space_name_two_jobs(store):
    first = store.publishes.record("p1", "t", "celery", "{}", 5, idempotency_key="order-7")
    second = store.publishes.record("p2", "t", "celery", "{}", 5, idempotency_key="order-7 ")

    assert (first, second) == ((True, "p1"), (True, "p2"))
