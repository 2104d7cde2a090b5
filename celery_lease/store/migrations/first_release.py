"""The first release's tables, frozen: revision 0001 creates them, and a store made by that
release (which had no version table) is recognised by them.

Never edit: later changes are later revisions.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = ["tables"]

ID = 255


def _key() -> sa.types.TypeEngine:
    return sa.String(ID).with_variant(mysql.VARCHAR(ID, collation="utf8mb4_bin"), "mysql", "mariadb")


def _time(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.Double(), nullable=nullable)


def tables(p: str) -> sa.MetaData:
    """The first release's tables for prefix ``p``, exactly as it created them."""
    md = sa.MetaData()
    jobs = sa.Table(
        f"{p}jobs", md,
        sa.Column("id", sa.String(ID), primary_key=True),
        sa.Column("queue_name", sa.String(ID), nullable=True),
        sa.Column("task_name", sa.String(ID), nullable=False),
        sa.Column("payload", sa.Text(), nullable=True),
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
        sa.Column("locked_by", sa.String(ID), nullable=True),
        sa.Column("lock_token", sa.String(64), nullable=True),
        sa.Column("idempotency_key", _key(), nullable=True),
        sa.Column("checkpoint", sa.Text(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        _time("created_at", nullable=False),
        _time("updated_at", nullable=False),
        sa.UniqueConstraint("idempotency_key", name=f"{p}jobs_idempotency_key_uq"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed')", name=f"{p}jobs_status_ck"
        ),
    )
    sa.Index(f"{p}jobs_status_lease_ix", jobs.c.status, jobs.c.lease_expires_at, jobs.c.id)
    sa.Index(f"{p}jobs_status_available_ix", jobs.c.status, jobs.c.available_at, jobs.c.id)
    sa.Index(f"{p}jobs_locked_by_ix", jobs.c.locked_by)
    sa.Index(f"{p}jobs_status_updated_ix", jobs.c.status, jobs.c.updated_at)
    events = sa.Table(
        f"{p}events", md,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("job_id", sa.String(ID), nullable=True),
        sa.Column("event", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("worker", sa.String(ID), nullable=True),
        sa.Column("token", sa.String(16), nullable=True),
        _time("at", nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
    )
    sa.Index(f"{p}events_job_ix", events.c.job_id, events.c.id)
    sa.Index(f"{p}events_at_ix", events.c.at)
    sa.Index(f"{p}events_event_at_ix", events.c.event, events.c.at)
    sa.Table(
        f"{p}workers", md,
        sa.Column("worker_id", sa.String(ID), primary_key=True),
        sa.Column("hostname", sa.String(ID), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        _time("started_at", nullable=False),
        _time("last_seen_at", nullable=False),
    )
    effects = sa.Table(
        f"{p}effects", md,
        sa.Column("key", _key(), primary_key=True),
        sa.Column("job_id", sa.String(ID), nullable=False),
        _time("at", nullable=False),
    )
    sa.Index(f"{p}effects_job_ix", effects.c.job_id)
    sa.Table(
        f"{p}locks", md,
        sa.Column("resource", _key(), primary_key=True),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(ID), nullable=True),
        sa.Column("owner", sa.String(ID), nullable=True),
        _time("expires_at", nullable=False),
    )
    return md
