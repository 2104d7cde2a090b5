"""A job's previous attempt, kept in the detail of the decision event that ends or replaces it.

The row holds only the last attempt; each re-claim, takeover or recovery reads the one it replaces while
holding the row, so the events hold every earlier attempt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..config import RECOVERY
from ..vocabulary import Event
from .base import StoreEngine
from .rows import PENDING, fenced_status

__all__ = ["PREVIOUS_OWNER", "PREVIOUS_TOKEN", "PREVIOUS_STARTED_AT", "attempt_detail", "previous_attempt",
           "reclaim_pending"]

# The keys of a decision event's detail that name the attempt it ended or replaced.
PREVIOUS_OWNER, PREVIOUS_TOKEN = "previous_owner", "previous_token"
PREVIOUS_STARTED_AT = "previous_started_at"


def attempt_detail(owner: str | None, token: str | None, started_at: float | None) -> dict[str, Any]:
    """An attempt as an event's detail records it: its owner, its token's first 8 characters, its start."""
    return {PREVIOUS_OWNER: owner, PREVIOUS_TOKEN: token[:8] if token else None,
            PREVIOUS_STARTED_AT: started_at}


def previous_attempt(db: StoreEngine, c: Connection, *where: sa.ColumnElement[bool]) -> dict[str, Any] | None:
    """The attempt of the jobs row ``where`` finds, holding that row for the caller's write (None: no row)."""
    j = db.t.jobs
    row = c.execute(db.dialect.hold_rows(sa.select(j.c.locked_by, j.c.lock_token, j.c.started_at)
                                         .where(*where), j)).first()
    return None if row is None else attempt_detail(row.locked_by, row.lock_token, row.started_at)


def reclaim_pending(db: StoreEngine, c: Connection, job_id: str, worker: str, token: str,
                    lease: Mapping[str, Any], recovery: Mapping[str, Any] | None,
                    started: bool = True) -> bool:
    """A pending, available job that ran before -> ours, audited ``claimed`` with the attempt before; False
    when it is no longer such a job. Not ``started``: the first claim of a row the one-statement claim leaves
    to the caller (a replaced job's carrier), audited as that claim is."""
    j = db.t.jobs
    where = [j.c.id == job_id, fenced_status(j.c.status, PENDING),
             j.c.started_at.is_not(None) if started else j.c.started_at.is_(None),
             j.c.available_at <= db.now_sql + db.clock_tolerance]
    previous = previous_attempt(db, c, *where)
    if previous is None:
        return False
    # As the one-statement claim: the running code's recovery policy replaces the recorded one.
    given = recovery or {}
    policy = {name: given[name] for name in RECOVERY if given.get(name) is not None}
    if c.execute(sa.update(j).where(*where).values(**lease, **policy)).rowcount != 1:
        return False
    if started:
        db._event(c, job_id, Event.CLAIMED, "claimed again after an earlier attempt", worker, token, previous)
    elif db.audit_every_transition:  # the carrier's first claim is audited as a first claim is
        db._event(c, job_id, Event.CLAIMED, None, worker, token)
    return True
