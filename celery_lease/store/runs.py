"""The reaper's runs and the store's small facts (revision 0004): liveness read from the store, whichever
scheduler runs the reaper; without the tables readers answer None and writers write nothing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from .base import RUNS_REVISION, StoreEngine

__all__ = ["RunStatements", "EXPORTER_SCRAPE"]

EXPORTER_SCRAPE = "exporter_last_scrape"  # meta key: when an exporter last answered a scrape


class RunStatements:
    """Reaper runs (recorded, pruned, read back) and the meta table's facts."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    @property
    def supports_runs(self) -> bool:
        """Whether the schema has the reaper_runs and meta tables (revision 0004 or later)."""
        return self.db.at_least(RUNS_REVISION)

    def record_reaper_run(self, duration: float, counts: Mapping[str, Any], worker: str | None,
                          keep: int) -> bool:
        """Record a finished run and drop all but the newest ``keep``; False on a schema without the table."""
        if not self.supports_runs:
            return False
        r = self.db.t.reaper_runs
        with self.db.begin() as c:
            c.execute(sa.insert(r).values(
                started_at=self.db.now_sql - duration, finished_at=self.db.now_sql, duration=duration,
                worker=worker, counts=json.dumps(dict(counts), default=str)))
            # The id of the oldest run to keep: one index walk of ``keep`` rows, then a range delete.
            floor = c.execute(sa.select(r.c.id).order_by(r.c.id.desc()).offset(keep - 1).limit(1)).scalar()
            if floor is not None:
                c.execute(sa.delete(r).where(r.c.id < floor))
        return True

    def reaper_runs(self, limit: int = 10) -> list[dict[str, Any]] | None:
        """The newest ``limit`` runs, newest first (counts decoded); None on a schema without them."""
        if not self.supports_runs:
            return None
        r = self.db.t.reaper_runs
        with self.db.begin(long=True, read=True) as c:
            rows = c.execute(sa.select(r).order_by(r.c.id.desc()).limit(limit)).all()
        return [{**row._mapping, "counts": json.loads(row.counts) if row.counts else {}} for row in rows]

    def last_reaper_run(self) -> tuple[float, dict[str, Any] | None] | None:
        """(store now, the newest run or None when none is recorded); None on a schema without runs."""
        runs = self.reaper_runs(1)
        if runs is None:
            return None
        return self.db.now(), (runs[0] if runs else None)

    def set_meta(self, key: str, value: str | None = None) -> bool:
        """Set a fact (its updated_at is the store's now); False on a schema without the table."""
        if not self.supports_runs:
            return False
        with self.db.begin() as c:
            c.execute(self.db.dialect.upsert(self.db.t.meta, {"key": key, "value": value,
                                                              "updated_at": self.db.now_sql},
                                             update=("value", "updated_at")))
        return True

    def meta_age(self, key: str) -> tuple[float | None, str | None] | None:
        """(seconds since the fact was set or None when never, its value); None without the table."""
        if not self.supports_runs:
            return None
        m = self.db.t.meta
        with self.db.begin(long=True, read=True) as c:
            age = self.db.now_sql - m.c.updated_at
            row = c.execute(sa.select(age, m.c.value).where(m.c.key == key)).first()
        return (None, None) if row is None else (float(row[0]), row[1])
