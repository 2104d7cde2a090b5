"""Shared set-up of the crash tests: a store on a server the test owns, the record the bodies write.

The store is read through its own engine, so a read while the server is down answers None
instead of raising; every wait on it has a deadline.
"""

from __future__ import annotations

import collections
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from celery_lease.errors import LeaseError
from celery_lease.store import Store
from tests.apps.crash_app import make_app
from tests.conftest import unique_prefix

APP = "tests.apps.crash_app"
STEPS, PAUSE = 3, 0.3  # each job: three steps (effect + checkpoint) of 0.3 s
# Events that only a recovery writes: none may appear when no lease was lost.
RECOVERY_EVENTS = ("reaped_expired_lease", "lease_taken_over", "dead_lettered", "failed")


@dataclass(frozen=True)
class Line:
    kind: str
    job: str
    attempt: int
    token: str
    pid: int
    at: float
    detail: str


@dataclass
class Execution:
    """One body's run of a job (one claim, one token), from the record: its lines in order."""

    job: str
    token: str
    lines: list[Line]

    @property
    def started_at(self) -> float:
        return self.lines[0].at

    @property
    def finished(self) -> bool:
        return any(line.kind == "finished" for line in self.lines)

    @property
    def last_trusted_at(self) -> float:
        """The last moment this body acted on its lease (an effect, a checkpoint, a passed check)."""
        return max((line.at for line in self.lines if line.kind in ("effect", "step", "finished")),
                   default=self.started_at)


class CrashEnv:
    """One test's store, record file and the environment its worker subprocesses get."""

    def __init__(self, tmp_path: Path, store_url: str, broker_url: str, **conf: Any) -> None:
        self.prefix = unique_prefix()
        self.record_path = tmp_path / "record.txt"
        self.store_url, self.broker_url, self.conf = store_url, broker_url, conf
        self.store = Store(store_url, self.prefix)
        self.store.migrate()

    def env(self) -> dict[str, str]:
        return {"CRASH_BROKER": self.broker_url, "CRASH_STORE": self.store_url, "CRASH_PREFIX": self.prefix,
                "CRASH_RECORD": str(self.record_path), "CRASH_CONF": json.dumps(self.conf)}

    def app(self):
        """The test process's twin of the workers' app (to publish and to reap)."""
        return make_app(self.env())

    def publish(self, app, count: int) -> list[str]:
        steps = app.tasks["crash.steps"]
        return [steps.delay(STEPS, PAUSE).id for _ in range(count)]

    # -- the record -------------------------------------------------------------------------------
    def lines(self) -> list[Line]:
        if not self.record_path.exists():
            return []
        out = []
        for raw in self.record_path.read_text().splitlines():
            kind, job, attempt, token, pid, at, *detail = raw.split(" ")
            out.append(Line(kind, job, int(attempt), token, int(pid), float(at), " ".join(detail)))
        return out

    def executions(self) -> dict[str, list[Execution]]:
        """Each job's executions, oldest first (one per claim: each has a token of its own)."""
        by_run: dict[tuple[str, str], list[Line]] = collections.defaultdict(list)
        for line in self.lines():
            by_run[(line.job, line.token)].append(line)
        jobs: dict[str, list[Execution]] = collections.defaultdict(list)
        for (job, token), lines in sorted(by_run.items(), key=lambda item: item[1][0].at):
            jobs[job].append(Execution(job, token, lines))
        return jobs

    def running(self, at: float | None = None) -> set[str]:
        """Jobs with a body under way now (or at wall time ``at``): started, not finished nor out
        with an exception."""
        open_runs: set[tuple[str, str]] = set()
        for line in self.lines():
            if at is not None and line.at > at:
                continue
            if line.kind == "started":
                open_runs.add((line.job, line.token))
            elif line.kind in ("finished", "lost", "error"):
                open_runs.discard((line.job, line.token))
        return {job for job, _ in open_runs}

    def finished(self) -> int:
        return sum(line.kind == "finished" for line in self.lines())

    def effect_counts(self) -> collections.Counter[str]:
        return collections.Counter(line.detail for line in self.lines() if line.kind == "effect")

    # -- the store, None while it does not answer --------------------------------------------------
    def statuses(self, ids: list[str]) -> dict[str, str] | None:
        j = self.store.t.jobs
        try:
            with self.store.engine.connect() as c:
                rows = c.execute(sa.select(j.c.id, j.c.status).where(j.c.id.in_(ids))).all()
        except (sa.exc.DBAPIError, LeaseError):
            return None
        return {row.id: row.status for row in rows}

    def all_completed(self, ids: list[str]) -> bool:
        statuses = self.statuses(ids) or {}
        failed = [job for job, status in statuses.items() if status == "failed"]
        assert not failed, f"jobs ended failed: {failed}"
        return len(statuses) == len(ids) and set(statuses.values()) == {"completed"}

    def recovery_events(self) -> list[tuple[str, str, str]]:
        return [(e["event"], e["job_id"], e["reason"]) for name in RECOVERY_EVENTS
                for e in self.store.reports.events(event=name)]

    def close(self) -> None:
        self.store.engine.dispose()


def assert_each_effect_once(env: CrashEnv, ids: list[str]) -> None:
    """Every step of every job has its effect recorded, and exactly once."""
    counts = env.effect_counts()
    expected = {f"{job}:{step}" for job in ids for step in range(STEPS)}
    assert set(counts) == expected, sorted(set(counts) ^ expected)
    assert {key for key, n in counts.items() if n > 1} == set(), counts


def assert_one_owner_at_a_time(runs: dict[str, list[Execution]]) -> None:
    """No execution of a job acted on its lease after the next execution of that job began."""
    overlaps = [(job, a.token[:8], a.last_trusted_at, b.token[:8], b.started_at)
                for job, execs in runs.items() for a, b in itertools.pairwise(execs)
                if a.last_trusted_at >= b.started_at]
    assert overlaps == [], overlaps
