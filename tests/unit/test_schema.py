"""celery_lease.store.schema: the tables at the newest revision and their deterministic names."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from celery_lease import config
from celery_lease.store import schema

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
        assert {ix.name for ix in table.indexes} <= have, table.name


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
