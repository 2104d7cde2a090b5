"""What a claim reads of a job's hand-overs (``Task.replace()``): whether a delivery is the replacement's or a
copy of the message of the run the job was replaced from, which must not run that body a second time."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..vocabulary import Event
from .base import StoreEngine
from .rows import PENDING, RUNNING, ClaimTerms, Job

__all__ = ["never_handed_over", "was_handed_over", "replaced_by_step", "replaced_copy"]


def never_handed_over(db: StoreEngine) -> sa.ColumnElement[bool]:
    """The row was never replaced: only claim() may decide whether a delivery of a replaced job is its
    carrier or a copy of the replaced run's message (one index probe, on the events of that job)."""
    e, j = db.t.events, db.t.jobs
    return ~sa.exists().where(e.c.job_id == j.c.id, e.c.event == Event.HANDED_OVER)


def was_handed_over(db: StoreEngine, job_id: str) -> bool:
    """never_handed_over() read apart, where a write's subquery would lock what it reads (the dialect's
    fence_locks_rows): a consistent read. A hand-over commits before its carrier's row is recorded, so a
    first claim that reads none after it cannot meet a replaced row."""
    e = db.t.events
    with db.begin(read=True) as c:
        return c.execute(sa.select(e.c.id).where(e.c.job_id == job_id, e.c.event == Event.HANDED_OVER)
                         .limit(1)).first() is not None


def replaced_by_step(db: StoreEngine, c: Connection, job_id: str, nesting: int) -> str | None:
    """The first step's id when the job's last hand-on is a recorded hand-over to a chain's first
    step, by a run nested at least as deep as this delivery; an unrecorded one leaves the copy
    of the message as the job's only way on."""
    detail = _last_hand_over(db, c, job_id, nesting, (Event.PUBLISHED, Event.CLAIMED))
    return str(detail["first_step"]) if detail and detail.get("first_step") else None


def replaced_copy(db: StoreEngine, c: Connection, current: Job, terms: ClaimTerms) -> bool:
    """Whether this delivery, which could claim the row, is a copy of a replaced run's message: the row
    holds a deeper message (the replacement's), the job was handed over by a run nested at least as deep
    as this delivery and shallower than that message, and it was not published again on purpose since.
    Only then: the row's message, sent again, is never refused here, and a row that holds no replacement
    (its id published anew after its row went) or a worker whose messages carry no nesting (task_protocol
    1, Celery before 5.3.5: ``terms.carried`` None) compares nothing."""
    if terms.carried is None or not (
            current.status == PENDING or (current.status == RUNNING and terms.takeover)):
        return False
    deeper = terms.carried(current.payload)
    if deeper is None or deeper <= terms.nesting:  # no copy is as deep as the row's message: no read
        return False
    detail = _last_hand_over(db, c, current.id, terms.nesting, (Event.REPUBLISHED,))
    return detail is not None and deeper > int(detail["nesting"] or 0)


def _last_hand_over(db: StoreEngine, c: Connection, job_id: str, nesting: int,
                    since: tuple[Event, ...]) -> dict[str, Any] | None:
    """The detail of the job's last hand-over when no event of ``since`` followed it and the run it
    replaced was nested at least ``nesting`` deep (a hand-over from before nesting was recorded: None)."""
    e = db.t.events
    last = c.execute(sa.select(e.c.event, e.c.detail).where(
        e.c.job_id == job_id, e.c.event.in_((Event.HANDED_OVER, *since)),
    ).order_by(e.c.id.desc()).limit(1)).first()
    if last is None or last.event != Event.HANDED_OVER or not last.detail:
        return None
    try:
        detail = json.loads(last.detail)
    except ValueError:
        return None
    if not isinstance(detail, dict) or "nesting" not in detail:
        return None
    return detail if int(detail["nesting"] or 0) >= nesting else None
