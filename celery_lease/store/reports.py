"""Statements for operators' reads: status, listings, metrics, tuning samples, the audit log.

A Prometheus scrape reads only indexed ranges: the work in flight, and what finished since the previous
scrape; never the whole history."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ..errors import JobNotFound
from .base import StoreEngine, where_given
from .rows import COMPLETED, FAILED, PENDING, RUNNING, Job, status_sql

__all__ = ["ReportStatements"]

def _f(value: Any) -> float | None:
    return None if value is None else float(value)


def _bucket(value: Any, bounds: Sequence[float]) -> Any:
    """The index of the first bound that ``value`` does not exceed (len(bounds) past the last)."""
    return sa.case(*((value <= b, i) for i, b in enumerate(bounds)), else_=len(bounds))


class ReportStatements:
    """Operators' reads, with the store's long bound (one may scan history; no lease waits on it);
    the reads of one job's events, effect key or lock keep the call bound."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def _now(self, c: sa.Connection) -> float:
        return float(c.execute(sa.select(self.db.now_sql)).scalar_one())

    def job_counts(self) -> list[tuple[str | None, str, int]]:
        """(queue, status, count) over the whole table: an operator's one-off read, not a scrape."""
        j = self.db.t.jobs
        with self.db.begin(long=True, read=True) as c:
            rows = c.execute(sa.select(j.c.queue_name, j.c.status, sa.func.count())
                             .group_by(j.c.queue_name, j.c.status)).all()
        return sorted(((r[0], r[1], int(r[2])) for r in rows), key=lambda r: (r[0] or "", r[1]))

    def running_rows(self, limit: int = 10_000, by_start: bool = False) -> tuple[float, list[dict[str, Any]]]:
        """The store's now and up to ``limit`` running jobs (oldest lease first; ``by_start``: longest
        running first) with their ages."""
        j = self.db.t.jobs
        order = ((j.c.started_at.is_(None), j.c.started_at) if by_start else ()) + (j.c.lease_expires_at,)
        with self.db.begin(long=True, read=True) as c:
            now = self._now(c)
            rows = c.execute(
                sa.select(j.c.id, j.c.task_name, j.c.queue_name, j.c.locked_by, j.c.started_at,
                          j.c.lease_expires_at, sa.func.coalesce(j.c.last_heartbeat_at, j.c.started_at),
                          j.c.lease_duration)
                .where(j.c.status == status_sql(RUNNING)).order_by(*order, j.c.id).limit(limit)
            ).all()
        return now, [
            {"id": r[0], "task": r[1], "queue": r[2], "owner": r[3], "started_at": _f(r[4]),
             "lease_expires_at": _f(r[5]), "heartbeat_lag": now - float(r[6]) if r[6] is not None else None,
             "lease_duration": _f(r[7])}
            for r in rows
        ]

    def expired_leases(self) -> int:
        """Running jobs whose lease has expired, all of them (a page reads at most ``running_rows``'s)."""
        j = self.db.t.jobs
        with self.db.begin(long=True, read=True) as c:
            return int(c.execute(sa.select(sa.func.count()).where(
                j.c.status == status_sql(RUNNING), j.c.lease_expires_at < self.db.now_sql)).scalar_one())

    def overview_counts(self, since: float) -> tuple[float, list[tuple[str | None, str, int]]]:
        """The store's now and (queue, status, count) of every pending, running and failed job and the
        jobs completed in the last ``since`` seconds: index ranges, never every completed row."""
        j = self.db.t.jobs
        open_ = [PENDING, RUNNING, FAILED]
        with self.db.begin(long=True, read=True) as c:
            now = self._now(c)
            rows = c.execute(sa.select(j.c.queue_name, j.c.status, sa.func.count())
                             .where(j.c.status.in_([status_sql(s) for s in open_]))
                             .group_by(j.c.queue_name, j.c.status)).all()
            # A bound value, not the clock expression: an index range needs a constant.
            done = c.execute(sa.select(j.c.queue_name, sa.func.count())
                             .where(j.c.status == status_sql(COMPLETED), j.c.updated_at > now - since)
                             .group_by(j.c.queue_name)).all()
        counts = [(r[0], str(r[1]), int(r[2])) for r in rows]
        counts += [(r[0], COMPLETED.value, int(r[1])) for r in done]
        return now, sorted(counts, key=lambda r: (r[0] or "", r[1]))

    def list_workers(self, limit: int = 100) -> tuple[float, list[dict[str, Any]]]:
        """The store's now and up to ``limit`` worker processes, latest seen first, each with ``alive``."""
        w = self.db.t.workers
        with self.db.begin(long=True, read=True) as c:
            now = self._now(c)
            rows = c.execute(sa.select(w).order_by(w.c.last_seen_at.desc(), w.c.worker_id).limit(limit)).all()
        stale_after = self.db.stale_after
        return now, [{**r._mapping, "alive": now - float(r.last_seen_at) <= stale_after} for r in rows]

    def worker_counts(self) -> dict[str, int]:
        """Registered worker processes seen within lease_worker_stale_after (alive) or not (stale)."""
        w = self.db.t.workers
        alive = sa.case((w.c.last_seen_at >= self.db.now_sql - self.db.stale_after, 1), else_=0)
        with self.db.begin(long=True, read=True) as c:
            total, live = c.execute(sa.select(sa.func.count(), sa.func.sum(alive))).one()
        return {"alive": int(live or 0), "stale": int(total or 0) - int(live or 0)}

    def worker_pools(self) -> dict[str, int]:
        """Pools of the live worker processes: name -> processes."""
        w = self.db.t.workers
        with self.db.begin(read=True) as c:
            alive = w.c.last_seen_at >= self.db.now_sql - self.db.stale_after
            rows = c.execute(sa.select(w.c.pool, sa.func.count()).where(alive, w.c.pool.is_not(None))
                             .group_by(w.c.pool)).all()
        return {r[0]: int(r[1]) for r in rows}

    def alive_workers(self) -> set[str]:
        """Ids of worker processes seen within lease_worker_stale_after (the registry is small)."""
        w = self.db.t.workers
        with self.db.begin(long=True, read=True) as c:
            alive = w.c.last_seen_at >= self.db.now_sql - self.db.stale_after
            return {r[0] for r in c.execute(sa.select(w.c.worker_id).where(alive))}

    def workers_last_seen(self, worker_ids: Sequence[str]) -> tuple[float, dict[str, float]]:
        """The store's time and when each of these registered worker processes was last seen."""
        w = self.db.t.workers
        with self.db.begin(long=True, read=True) as c:
            now = self._now(c)
            if not worker_ids:
                return now, {}
            rows = c.execute(sa.select(w.c.worker_id, w.c.last_seen_at)
                             .where(w.c.worker_id.in_(list(worker_ids)))).all()
        return now, {r[0]: float(r[1]) for r in rows}

    def event_counts(self, names: Sequence[str], since: float | None = None,
                     until: float | None = None) -> dict[str, int]:
        """Events by name with ``since < at <= until`` (store epoch seconds); one range of the
        (event, at) index per name, so the cost follows the events in range, not the log."""
        e = self.db.t.events
        q = sa.select(e.c.event, sa.func.count()).where(e.c.event.in_(list(names))).group_by(e.c.event)
        if since is not None:
            q = q.where(e.c.at > since)
        if until is not None:
            q = q.where(e.c.at <= until)
        with self.db.begin(long=True, read=True) as c:
            rows = c.execute(q).all()
        return {name: 0 for name in names} | {r[0]: int(r[1]) for r in rows}

    def labelled_event_counts(self, names: Sequence[str], since: float,
                              until: float) -> dict[tuple[str, str | None, str | None], int]:
        """Events by (name, queue, task) with ``since < at <= until``; queue and task are None
        where the writer did not know them."""
        e = self.db.t.events
        keys = [e.c.event, e.c.queue_name, e.c.task_name]
        q = (sa.select(*keys, sa.func.count()).where(e.c.event.in_(list(names)), e.c.at > since,
                                                     e.c.at <= until).group_by(*keys))
        with self.db.begin(long=True, read=True) as c:
            rows = c.execute(q).all()
        return {(r[0], r[1], r[2]): int(r[-1]) for r in rows}

    def list_jobs(self, status: str | None = None, queue: str | None = None, task: str | None = None,
                  expired: bool = False, limit: int = 50, owner: str | None = None,
                  since: float | None = None) -> list[Job]:
        """Jobs matching the filters, most recently changed first (expired: oldest lease first);
        ``owner`` is the worker holding or last holding the lease, ``since`` seconds back from now
        bounds when the job last changed."""
        j = self.db.t.jobs
        q = sa.select(*self.db._job_columns()).limit(limit)
        if expired:
            q = q.where(j.c.status == status_sql(RUNNING), j.c.lease_expires_at < self.db.now_sql)
            q = q.order_by(j.c.lease_expires_at, j.c.id)
        else:
            q = q.order_by(j.c.updated_at.desc(), j.c.id)
        q = where_given(q, (j.c.status, status), (j.c.queue_name, queue), (j.c.task_name, task),
                        (j.c.locked_by, owner))
        with self.db.begin(long=True, read=True) as c:
            if since is not None:
                q = q.where(j.c.updated_at >= self._now(c) - since)  # bound: an index range (list_events)
            return [Job.from_row(r) for r in c.execute(q)]

    def require(self, job_id: str) -> Job:
        job = self.db.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def job_ids_starting(self, prefix: str, limit: int = 10) -> list[str]:
        """Up to ``limit`` job ids that start with ``prefix`` (LIKE's wildcards in it escaped), sorted."""
        j = self.db.t.jobs
        q = sa.select(j.c.id).where(j.c.id.startswith(prefix, autoescape=True)).order_by(j.c.id).limit(limit)
        with self.db.begin(long=True, read=True) as c:
            return list(c.execute(q).scalars())

    def list_events(self, job_id: str | None = None, since: float | None = None,
                    event: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Audit events, newest ``limit`` of them in time order; ``since`` is seconds back from now."""
        e = self.db.t.events
        q = where_given(sa.select(e).order_by(e.c.id.desc()).limit(limit),
                        (e.c.job_id, job_id), (e.c.event, event))
        with self.db.begin(long=True, read=True) as c:
            if since is not None:
                # A bound value: PostgreSQL cannot range-scan an index against volatile clock_timestamp().
                q = q.where(e.c.at >= self._now(c) - since)
            rows = [dict(r._mapping) for r in c.execute(q)]
        return rows[::-1]

    def running_metrics(self, lag_buckets: Sequence[float]) -> tuple[float, list[dict[str, Any]]]:
        """Per (queue, task) over running jobs: count, expired leases, oldest start, heartbeat lag
        max/sum and cumulative bucket counts. Bounded by the jobs in flight."""
        j = self.db.t.jobs
        with self.db.begin(long=True, read=True) as c:
            now = self._now(c)
            at: sa.BindParameter[float] = sa.literal(now, sa.Double())
            since = at - sa.func.coalesce(j.c.last_heartbeat_at, j.c.started_at, at)
            # A heartbeat committed after ``at`` was read (or a clock stepped back) is no lag, not a negative
            # one: the histogram's sum is a counter, and a drop reads as a reset.
            lag = sa.case((since > 0, since), else_=0.0)
            cols = [j.c.queue_name, j.c.task_name, sa.func.count(),
                    sa.func.sum(sa.case((j.c.lease_expires_at < at, 1), else_=0)),
                    sa.func.min(j.c.started_at), sa.func.max(lag), sa.func.sum(lag)]
            cols += [sa.func.sum(sa.case((lag <= b, 1), else_=0)) for b in lag_buckets]
            rows = c.execute(sa.select(*cols).where(j.c.status == status_sql(RUNNING))
                             .group_by(j.c.queue_name, j.c.task_name)).all()
        return now, [{
            "queue": r[0], "task": r[1], "running": int(r[2]), "expired": int(r[3] or 0),
            "oldest_started_at": _f(r[4]), "lag_max": _f(r[5]) or 0.0, "lag_sum": _f(r[6]) or 0.0,
            "lag_buckets": [int(v or 0) for v in r[7:]],
        } for r in rows]

    def pending_metrics(self) -> tuple[float, list[dict[str, Any]]]:
        """Per queue: pending depth and the oldest ``available_at`` already due."""
        j = self.db.t.jobs
        with self.db.begin(long=True, read=True) as c:
            now = self._now(c)
            due = sa.case((j.c.available_at <= now, j.c.available_at), else_=None)
            rows = c.execute(sa.select(j.c.queue_name, sa.func.count(), sa.func.min(due))
                             .where(j.c.status == status_sql(PENDING)).group_by(j.c.queue_name)).all()
        return now, [{"queue": r[0], "pending": int(r[1]), "oldest_due_at": _f(r[2])} for r in rows]

    def finished_between(self, since: float, until: float, runtime_buckets: Sequence[float],
                         attempt_buckets: Sequence[float]) -> dict[tuple[str | None, str], Any]:
        """Per (queue, task) over jobs finished with ``since < updated_at <= until``: runtime (completed)
        and attempts bucket counts, then the +Inf count, then the sum (not cumulative); one index range
        per status."""
        j = self.db.t.jobs
        sums: dict[tuple[str | None, str], dict[str, list[float]]] = {}
        rt = sa.func.coalesce(j.c.completed_at - j.c.started_at, 0.0)
        with self.db.begin(long=True, read=True) as c:
            for status in (COMPLETED, FAILED):
                # One bucket index per row and GROUP BY it: one CASE per row instead of one per bucket.
                rb, ab = _bucket(rt, runtime_buckets), _bucket(j.c.attempt_count, attempt_buckets)
                q = (sa.select(j.c.queue_name, j.c.task_name, rb, ab, sa.func.count(), sa.func.sum(rt),
                               sa.func.sum(j.c.attempt_count))
                     .where(j.c.status == status, j.c.updated_at > since, j.c.updated_at <= until)
                     .group_by(j.c.queue_name, j.c.task_name, rb, ab))
                for queue, task, r_ix, a_ix, n, rt_sum, a_sum in c.execute(q):
                    entry = sums.setdefault((queue, task), {})
                    if status == COMPLETED:
                        runtime = entry.setdefault("runtime", [0.0] * (len(runtime_buckets) + 2))
                        runtime[int(r_ix)] += int(n)
                        runtime[-1] += float(rt_sum or 0)
                    tries = entry.setdefault("attempts", [0.0] * (len(attempt_buckets) + 2))
                    tries[int(a_ix)] += int(n)
                    tries[-1] += float(a_sum or 0)
        return sums

    def finished_tasks(self, limit: int = 10_000) -> list[str]:
        """Task names among the newest ``limit`` completed jobs."""
        j = self.db.t.jobs
        sub = (sa.select(j.c.task_name).where(j.c.status == status_sql(COMPLETED))
               .order_by(j.c.updated_at.desc()).limit(limit).subquery())
        with self.db.begin(long=True, read=True) as c:
            return sorted(r[0] for r in c.execute(sa.select(sub.c.task_name).distinct()))

    def runtime_sample(self, task: str, limit: int = 10_000) -> list[tuple[float, float, str | None]]:
        """(runtime, heartbeat gap at completion, queue) of a task's newest ``limit`` completed jobs."""
        j = self.db.t.jobs
        q = (sa.select(j.c.completed_at - j.c.started_at,
                       j.c.completed_at - sa.func.coalesce(j.c.last_heartbeat_at, j.c.started_at),
                       j.c.queue_name)
             .where(j.c.task_name == task, j.c.status == status_sql(COMPLETED), j.c.started_at.is_not(None),
                    j.c.completed_at.is_not(None))
             .order_by(j.c.updated_at.desc()).limit(limit))
        with self.db.begin(long=True, read=True) as c:
            return [(float(r[0]), float(r[1]), r[2]) for r in c.execute(q)]

    def check_facts(self) -> dict[str, Any]:
        """What `lease check` reads besides durations: tables, hosts, delays and usage per task."""
        j, w, e, lk = self.db.t.jobs, self.db.t.workers, self.db.t.effects, self.db.t.locks
        with self.db.begin(long=True, read=True) as c:
            existing = set(sa.inspect(c).get_table_names())
        missing = [t.name for t in self.db.t.metadata.sorted_tables if t.name not in existing]
        if missing:
            return {"missing_tables": missing}
        usage = sa.select(
            j.c.task_name, sa.func.count(), sa.func.count(j.c.idempotency_key),
            sa.func.sum(sa.case((j.c.status == status_sql(FAILED), 1), else_=0)),
            sa.func.max(sa.case((sa.and_(j.c.status == status_sql(PENDING), j.c.attempt_count == 0),
                                 j.c.available_at - j.c.created_at), else_=None)),
        ).group_by(j.c.task_name)
        with self.db.begin(long=True, read=True) as c:
            hosts = [r[0] for r in c.execute(sa.select(w.c.hostname).distinct())]
            jobs = c.execute(usage).all()
            effects: dict[str, int] = dict(c.execute(sa.select(j.c.task_name, sa.func.count()).select_from(
                e.join(j, e.c.job_id == j.c.id)).group_by(j.c.task_name)).all())
            locks: dict[str, int] = dict(c.execute(sa.select(j.c.task_name, sa.func.count()).select_from(
                lk.join(j, lk.c.job_id == j.c.id)).group_by(j.c.task_name)).all())
        tasks = {name: {"jobs": int(n), "keyed": int(keyed), "failed": int(failed or 0),
                        "longest_delay": float(delay or 0.0), "effects": int(effects.get(name, 0)),
                        "locks": int(locks.get(name, 0))} for name, n, keyed, failed, delay in jobs}
        return {"missing_tables": [], "hosts": sorted(hosts), "tasks": tasks}

    def events(self, job_id: str | None = None, event: str | None = None,
               limit: int = 1000) -> list[dict[str, Any]]:
        """Audit events, oldest first, of one job or one name when given."""
        e = self.db.t.events
        q = where_given(sa.select(e).order_by(e.c.id).limit(limit), (e.c.job_id, job_id), (e.c.event, event))
        with self.db.begin(read=True) as c:
            return [dict(r._mapping) for r in c.execute(q)]

    def effect_record(self, key: str) -> dict[str, Any] | None:
        """An effect key's row (``key``, ``job_id``, ``at``), or None when no such key is recorded."""
        e = self.db.t.effects
        with self.db.begin(read=True) as c:
            row = c.execute(sa.select(e.c.key, e.c.job_id, e.c.at).where(e.c.key == key)).first()
        return None if row is None else dict(row._mapping)

    def effect_keys(self, job_id: str) -> list[str]:
        """The effect keys a job recorded, oldest first."""
        e = self.db.t.effects
        with self.db.begin(read=True) as c:
            return list(c.execute(sa.select(e.c.key).where(e.c.job_id == job_id).order_by(e.c.at)).scalars())

    def lock_holder(self, resource: str) -> dict[str, Any] | None:
        """The lock row of a resource (token, job_id, owner, expires_at), or None."""
        lk = self.db.t.locks
        with self.db.begin(read=True) as c:
            row = c.execute(sa.select(lk).where(lk.c.resource == resource)).first()
        return None if row is None else dict(row._mapping)
