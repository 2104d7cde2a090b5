"""The reaper's runs and the store's small facts: liveness read from the store, whichever scheduler runs
the reaper."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from .base import StoreEngine

__all__ = ["RunStatements", "EXPORTER_SCRAPE"]

EXPORTER_SCRAPE = "exporter_last_scrape"  # meta key: when an exporter last answered a scrape


class RunStatements:
    """Reaper runs (recorded, pruned, read back) and the meta table's facts."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def record_reaper_run(self, duration: float, counts: Mapping[str, Any], worker: str | None,
                          keep: int) -> None:
        """Record a finished run and drop all but the newest ``keep``."""
        r = self.db.t.reaper_runs
        with self.db.begin() as c:
            c.execute(sa.insert(r).values(
                started_at=self.db.now_sql - duration, finished_at=self.db.now_sql, duration=duration,
                worker=worker, counts=json.dumps(dict(counts), default=str)))
            # The id of the oldest run to keep: one index walk of ``keep`` rows, then a range delete.
            floor = c.execute(sa.select(r.c.id).order_by(r.c.id.desc()).offset(keep - 1).limit(1)).scalar()
            if floor is not None:
                c.execute(sa.delete(r).where(r.c.id < floor))

    def reaper_runs(self, limit: int = 10) -> list[dict[str, Any]]:
        """The newest ``limit`` runs, newest first (counts decoded)."""
        r = self.db.t.reaper_runs
        with self.db.begin(long=True, read=True) as c:
            rows = c.execute(sa.select(r).order_by(r.c.id.desc()).limit(limit)).all()
        return [{**row._mapping, "counts": json.loads(row.counts) if row.counts else {}} for row in rows]

    def last_reaper_run(self) -> tuple[float, dict[str, Any] | None]:
        """(store now, the newest run or None when none is recorded)."""
        runs = self.reaper_runs(1)
        return self.db.now(), (runs[0] if runs else None)

    def set_meta(self, key: str, value: str | None = None) -> None:
        """Set a fact (its updated_at is the store's now)."""
        with self.db.begin() as c:
            c.execute(self.db.dialect.upsert(self.db.t.meta, {"key": key, "value": value,
                                                              "updated_at": self.db.now_sql},
                                             update=("value", "updated_at")))

    def meta_age(self, key: str) -> tuple[float | None, str | None]:
        """(seconds since the fact was set or None when never, its value)."""
        m = self.db.t.meta
        with self.db.begin(long=True, read=True) as c:
            age = self.db.now_sql - m.c.updated_at
            row = c.execute(sa.select(age, m.c.value).where(m.c.key == key)).first()
        return (None, None) if row is None else (float(row[0]), row[1])
