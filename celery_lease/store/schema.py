"""The store's tables at the newest schema revision (SQLAlchemy Core), times in epoch seconds.

A change here lands with a new migration; test_migrations.py proves upgrading gives these tables."""

from __future__ import annotations

import dataclasses

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from ..vocabulary import Status

__all__ = ["Tables", "tables", "created_on", "STATUSES", "ID", "PARTIAL_INDEXES"]

STATUSES = tuple(s.value for s in Status)
ID = 255  # Celery task ids are UUIDs, but custom ids may be longer.
# The databases whose jobs indexes are partial (one status each); the others' lead with status.
PARTIAL_INDEXES = ("postgresql", "sqlite")
FULL_INDEXES = ("mysql", "mariadb")


def created_on(index: sa.Index, dialect_name: str) -> bool:
    """Whether ``index`` exists on a database of ``dialect_name`` (some are one family's only)."""
    return dialect_name in index.info.get("dialects", (dialect_name,))


@dataclasses.dataclass(frozen=True)
class Tables:
    """The tables of one store, sharing one MetaData."""

    metadata: sa.MetaData
    jobs: sa.Table
    events: sa.Table
    workers: sa.Table
    effects: sa.Table
    locks: sa.Table
    idempotency_keys: sa.Table
    reaper_runs: sa.Table
    meta: sa.Table


def _exact(collation: str) -> sa.types.TypeEngine:
    # MySQL/MariaDB's default collation ignores case, accents and trailing spaces, utf8mb4_bin trailing
    # spaces: "Order-42" and "order-42", or "k" and "k ", would be one job or one key.
    return sa.String(ID).with_variant(mysql.VARCHAR(ID, collation=collation), "mysql", "mariadb")


def _long_text() -> sa.types.TypeEngine:
    # MySQL/MariaDB's TEXT holds 64 KB; LONGTEXT holds what Celery carries (a message, a result).
    return sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


def _time(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.Double(), nullable=nullable)


def tables(prefix: str = "celery_lease_", key_collation: str | None = None) -> Tables:
    """Build the table definitions for a prefix (validated by config.py).

    ``key_collation``: the MySQL/MariaDB collation of the id and key columns, the server's own
    (Dialect.key_collation) when the tables are created; None: utf8mb4_bin, which every server has."""
    md = sa.MetaData()
    p = prefix

    def exact() -> sa.types.TypeEngine:
        return _exact(key_collation or "utf8mb4_bin")

    jobs = sa.Table(
        f"{p}jobs", md,
        sa.Column("id", exact(), primary_key=True),
        sa.Column("queue_name", sa.String(ID), nullable=True),
        sa.Column("task_name", sa.String(ID), nullable=False),
        sa.Column("payload", _long_text(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt_count", sa.Integer(), nullable=False, default=0),
        sa.Column("expired_count", sa.Integer(), nullable=False, default=0),
        sa.Column("dispatch_count", sa.Integer(), nullable=False, default=0),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        _time("available_at", nullable=False),
        _time("started_at"),
        _time("completed_at"),
        _time("failed_at"),
        _time("last_heartbeat_at"),
        _time("lease_expires_at"),
        sa.Column("lease_duration", sa.Double(), nullable=True),
        sa.Column("grace_period", sa.Double(), nullable=True),
        sa.Column("locked_by", exact(), nullable=True),
        sa.Column("lock_token", sa.String(64), nullable=True),
        sa.Column("idempotency_key", exact(), nullable=True),
        sa.Column("checkpoint", _long_text(), nullable=True),
        sa.Column("last_error", _long_text(), nullable=True),
        _time("created_at", nullable=False),
        _time("updated_at", nullable=False),
        # The task's recovery policy, for a reaper that does not import the task (NULL: app settings).
        sa.Column("on_expired", sa.String(16), nullable=True),
        sa.Column("max_expirations", sa.Integer(), nullable=True),
        sa.Column("backoff_base", sa.Double(), nullable=True),
        sa.Column("backoff_max", sa.Double(), nullable=True),
        sa.Column("backoff_jitter", sa.Boolean(create_constraint=False), nullable=True),
        sa.Column("dead_letter_queue", sa.String(ID), nullable=True),
        sa.Column("dispatch_timeout", sa.Double(), nullable=True),
        # Read only when a crash interrupted Celery's post-run work.
        sa.Column("result", _long_text(), nullable=True),
        sa.UniqueConstraint("idempotency_key", name=f"{p}jobs_idempotency_key_uq"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed')", name=f"{p}jobs_status_ck"
        ),
    )
    # The reaper's scans walk these by keyset. Partial (one status each) where the database has
    # them: PostgreSQL writes an entry in every index a changed row is in, so a claim skips these.
    for name, status, column in (("running_lease_ix", "running", jobs.c.lease_expires_at),
                                 ("pending_at_ix", "pending", jobs.c.available_at)):
        where = sa.text(f"status = '{status}'")
        sa.Index(f"{p}jobs_{name}", column, jobs.c.id, postgresql_where=where, sqlite_where=where,
                 info={"dialects": PARTIAL_INDEXES}).ddl_if(dialect=PARTIAL_INDEXES)  # type: ignore[arg-type]
    for name, column in (("status_lease_ix", jobs.c.lease_expires_at),
                         ("status_available_ix", jobs.c.available_at)):
        sa.Index(f"{p}jobs_{name}", jobs.c.status, column, jobs.c.id,
                 info={"dialects": FULL_INDEXES}).ddl_if(dialect=FULL_INDEXES)  # type: ignore[arg-type]
    # The heartbeat renews by owner; the CLI and pruning read by finish time.
    sa.Index(f"{p}jobs_locked_by_ix", jobs.c.locked_by)
    sa.Index(f"{p}jobs_status_updated_ix", jobs.c.status, jobs.c.updated_at)
    events = sa.Table(
        f"{p}events", md,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("job_id", exact(), nullable=True),
        sa.Column("event", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("worker", exact(), nullable=True),
        sa.Column("token", sa.String(16), nullable=True),
        _time("at", nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        # So counters are labelled without a join; NULL where the writer did not know the job.
        sa.Column("queue_name", sa.String(ID), nullable=True),
        sa.Column("task_name", sa.String(ID), nullable=True),
    )
    sa.Index(f"{p}events_job_ix", events.c.job_id, events.c.id)
    sa.Index(f"{p}events_at_ix", events.c.at)
    sa.Index(f"{p}events_event_at_ix", events.c.event, events.c.at)
    workers = sa.Table(
        f"{p}workers", md,
        sa.Column("worker_id", exact(), primary_key=True),
        sa.Column("hostname", sa.String(ID), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        _time("started_at", nullable=False),
        _time("last_seen_at", nullable=False),
        # The pool and concurrency the process runs (revision 0003), for `lease check`.
        sa.Column("pool", sa.String(32), nullable=True),
        sa.Column("concurrency", sa.Integer(), nullable=True),
    )
    effects = sa.Table(
        f"{p}effects", md,
        sa.Column("key", exact(), primary_key=True),
        sa.Column("job_id", exact(), nullable=False),
        _time("at", nullable=False),
        # The recording call's own mark (revision 0008): a call whose commit's answer was lost finds the
        # key it wrote itself on its next try, and is not told another attempt did the effect.
        sa.Column("nonce", sa.String(32), nullable=True),
    )
    sa.Index(f"{p}effects_job_ix", effects.c.job_id)
    locks = sa.Table(
        f"{p}locks", md,
        sa.Column("resource", exact(), primary_key=True),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("job_id", exact(), nullable=True),
        sa.Column("owner", exact(), nullable=True),
        _time("expires_at", nullable=False),
    )
    # Keys outlive their jobs: a pruned job must not free its key before lease_idempotency_retention.
    keys = sa.Table(
        f"{p}idempotency_keys", md,
        sa.Column("key", exact(), primary_key=True),
        sa.Column("job_id", exact(), nullable=False),
        _time("created_at", nullable=False),
    )
    sa.Index(f"{p}idempotency_keys_created_ix", keys.c.created_at)
    # Each reaper run that did its work (revision 0004): its liveness, whichever scheduler runs it.
    runs = sa.Table(
        f"{p}reaper_runs", md,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        _time("started_at", nullable=False),
        _time("finished_at", nullable=False),
        sa.Column("duration", sa.Double(), nullable=False),
        sa.Column("worker", exact(), nullable=True),
        sa.Column("counts", sa.Text(), nullable=True),
    )
    sa.Index(f"{p}reaper_runs_finished_ix", runs.c.finished_at)
    # Small facts kept by key (revision 0004), such as the exporter's last scrape.
    meta = sa.Table(
        f"{p}meta", md,
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text(), nullable=True),
        _time("updated_at", nullable=False),
    )
    return Tables(md, jobs, events, workers, effects, locks, keys, runs, meta)

