"""Read-only verbs: status, jobs, inspect, events, tune (playbook steps 1, 2 and 5)."""

from __future__ import annotations

from typing import Any

import click

import celery_lease.messaging.messages as messages
import celery_lease.ops.recovery as recovery

from ..config import worker_stale_after
from ..errors import StoreCorrupt
from ..ops.tuning import percentile
from ..ops.views import LAST_HOUR, STATUSES, event_dict, job_dict, job_row, job_timeline, reaper_status
from ..vocabulary import STALE_WRITES, Status
from .base import CommandError, app_of, json_option, lease, store_of
from .output import Duration, age, echo, emit_json, table, when

__all__ = ["reaper_status", "status", "jobs", "inspect", "events", "tune"]

JOB_COLUMNS = [("id", "job"), ("task", "task"), ("queue", "queue"), ("status", "status"),
               ("attempts", "attempts"), ("lease", "lease"), ("owner", "owner"),
               ("heartbeat", "heartbeat"), ("updated", "updated")]


@lease.command()
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """One screen: jobs by queue and status, expired leases, heartbeat lag, workers, last hour."""
    store = store_of(ctx)
    stale_after = worker_stale_after(app_of(ctx))
    counts = store.reports.job_counts()
    now, running = store.reports.running_rows()
    lags = [r["heartbeat_lag"] for r in running if r["heartbeat_lag"] is not None]
    # Over every running job, not only the rows read (at most 10,000, oldest lease first).
    oldest = next((r for r in store.reports.running_rows(1, by_start=True)[1] if r["started_at"] is not None),
                  None)
    hour = store.reports.event_counts(LAST_HOUR + STALE_WRITES, since=now - 3600)
    by_queue: dict[str, dict[str, int]] = {}
    for queue, state, n in counts:
        by_queue.setdefault(queue or "", dict.fromkeys(STATUSES, 0))[state] = n
    report: dict[str, Any] = {
        "store": store.safe_url, "tables": store.t.jobs.name, "now": now, "jobs": by_queue,
        "totals": {s: sum(q[s] for q in by_queue.values()) for s in STATUSES},
        "running": {
            "total": sum(n for _, state, n in counts if state == Status.RUNNING),
            "expired": store.reports.expired_leases(),
            "oldest": None if oldest is None else {**oldest, "age": now - oldest["started_at"]},
            "heartbeat_lag_max": max(lags, default=None), "heartbeat_lag_p95": percentile(lags, 95),
        },
        "workers": store.reports.worker_counts(),
        "last_hour": {str(k): v for k, v in hour.items() if k not in STALE_WRITES}
        | {"stale_writes_rejected": sum(v for k, v in hour.items() if k in STALE_WRITES)},
    }
    report["dead_letters"] = report["totals"][Status.FAILED.value]
    report["reaper"] = reaper_status(app_of(ctx), store)
    if as_json:
        emit_json(report)
        return
    run = report["running"]
    rows = [{"queue": q or "(none)", **n} for q, n in sorted(by_queue.items())]
    lines = [
        f"lease store    {report['store']} (table {report['tables']})",
        f"store time     {when(now)}", "",
        table(rows, [("queue", "queue"), *((s, s) for s in STATUSES)], empty="no jobs recorded yet"), "",
        f"running        {run['total']} ({run['expired']} with an expired lease)",
    ]
    if oldest is not None:
        lines.append(f"oldest running {oldest['id']} ({oldest['task']}) started "
                     f"{age(run['oldest']['age'])} ago on {oldest['owner']}")
    if lags:
        lines.append(f"heartbeat lag  max {age(run['heartbeat_lag_max'])}, "
                     f"p95 {age(run['heartbeat_lag_p95'])}")
    w = report["workers"]
    lines += [f"workers        {w['alive']} alive, {w['stale']} stale "
              f"(stale after {stale_after:g}s without a heartbeat)",
              f"dead letters   {report['dead_letters']}",
              f"reaper         {report['reaper']['summary']}",
              "last hour      " + ", ".join(f"{k.replace('_', ' ')} {v}"
                                            for k, v in report["last_hour"].items())]
    echo("\n".join(lines))


@lease.command()
@click.option("--status", "state", type=click.Choice(STATUSES), help="Only jobs in this status.")
@click.option("--queue", help="Only jobs of this queue.")
@click.option("--task", help="Only jobs of this task name.")
@click.option("--expired", is_flag=True, help="Only running jobs whose lease has expired.")
@click.option("--owner", help="Only jobs this worker holds or last held (a worker id, as in `status`).")
@click.option("--since", type=Duration(), help="Only jobs changed within this (30s, 10m, 2h, 1d).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1), help="Rows at most.")
@json_option
@click.pass_context
def jobs(ctx: click.Context, state: str | None, queue: str | None, task: str | None, expired: bool,
         owner: str | None, since: float | None, limit: int, as_json: bool) -> None:
    """Jobs as a table, most recently changed first (--expired: oldest lease first)."""
    store = store_of(ctx)
    found = store.reports.list_jobs(state, queue, task, expired, limit, owner=owner, since=since)
    if as_json:
        emit_json([job_dict(j) for j in found])
        return
    now = store.now()
    echo(table([job_row(j, now) for j in found], JOB_COLUMNS, empty="no jobs match"))


def event_row(e: dict[str, Any]) -> dict[str, Any]:
    return {**e, "at": when(e["at"])}


EVENT_COLUMNS = [("at", "at"), ("event", "event"), ("job_id", "job"), ("reason", "reason"),
                 ("worker", "worker"), ("token", "token")]


@lease.command()
@click.argument("job_id")
@json_option
@click.pass_context
def inspect(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """One job (its id or a unique prefix): its row, its stored message and its timeline (as events --job)."""
    store = store_of(ctx)
    job = store.reports.require(recovery.resolve_job_id(store, job_id))
    job_id = job.id
    history = job_timeline(job, store.reports.list_events(job_id=job_id, limit=1000))
    try:
        sig = messages.decode(job.payload, app_of(ctx).conf.accept_content, job.id)
        message: dict[str, Any] = {k: sig.get(k) for k in ("task", "args", "kwargs", "options")}
    except StoreCorrupt as exc:
        message = {"error": str(exc)}
    if as_json:
        emit_json({"job": job_dict(job, payload=True), "message": message,
                   "effects": store.reports.effect_keys(job_id), "events": [event_dict(e) for e in history]})
        return
    now = store.now()
    fields = job_dict(job)
    for key in ("available_at", "started_at", "completed_at", "failed_at", "last_heartbeat_at",
                "lease_expires_at", "created_at", "updated_at"):
        if fields.get(key) is not None:
            fields[key] = f"{when(fields[key])} ({age(now - fields[key])} ago)"
    width = max(map(len, fields))
    lines = [f"{key.ljust(width)}  {'' if value is None else value}" for key, value in fields.items()]
    keys = store.reports.effect_keys(job_id)
    lines += ["", "message", *(f"  {k}: {v}" for k, v in message.items()), "",
              "effect keys", *(f"  {k}" for k in keys or ["(none)"]), "", "events",
              table([event_row(e) for e in history], [*EVENT_COLUMNS, ("source", "source")],
                    empty="(no events)")]
    echo("\n".join(lines))


@lease.command()
@click.option("--job", "job_id", help="Only this job (its id or a unique prefix): its timeline, the stored "
              "events with the first claim and the completion its row records (source: row).")
@click.option("--since", type=Duration(), help="Only events newer than this (30s, 10m, 2h, 1d).")
@click.option("--event", help="Only events with this name (e.g. reaped_expired_lease).")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1), help="Newest rows at most.")
@json_option
@click.pass_context
def events(ctx: click.Context, job_id: str | None, since: float | None, event: str | None, limit: int,
           as_json: bool) -> None:
    """The audit log, oldest first among the newest --limit events.

    Without --job it lists stored events only: a first claim and its owner's completion write
    none (unless lease_audit_every_transition); the job's row records them, and --job shows them.
    """
    store = store_of(ctx)
    if (job_id is not None and store.get(job_id) is None and store.reports.job_ids_starting(job_id, 1)
            and not store.reports.list_events(job_id=job_id, limit=1)):
        job_id = recovery.resolve_job_id(store, job_id)  # a prefix; a deleted job's id stays exact
    if job_id is not None and store.get(job_id) is None and not store.reports.list_events(job_id=job_id,
                                                                                          limit=1):
        raise CommandError(f"no job {job_id!r} in the lease store, and no events of it (a deleted job's "
                           "events stay until pruned); list jobs with `celery lease jobs`")
    found = store.reports.list_events(job_id=job_id, since=since, event=event, limit=limit)
    columns = EVENT_COLUMNS
    if job_id is not None:
        after = None if since is None else store.now() - since
        found = [e for e in job_timeline(store.get(job_id), found)
                 if (event is None or e["event"] == event) and (after is None or e["at"] >= after)]
        found, columns = found[-limit:], [*EVENT_COLUMNS, ("source", "source")]
    if as_json:
        emit_json([event_dict(e) for e in found])
        return
    echo(table([event_row(e) for e in found], columns, empty="no events match"))


def _change(current: Any, recommended: Any) -> str:
    if recommended is None:
        return "" if current is None else f"{current:g}"
    now = "none" if current is None else f"{current:g}"
    return now if current == recommended else f"{now} -> {recommended:g}"


@lease.command()
@click.option("--task", help="Only this task.")
@click.option("--sample", default=10_000, show_default=True, type=click.IntRange(1),
              help="Newest completed jobs measured per task.")
@json_option
@click.pass_context
def tune(ctx: click.Context, task: str | None, sample: int, as_json: bool) -> None:
    """Runtime p50/p95/p99 per task and the lease settings they call for."""
    from ..ops.tuning import tune as measure

    results = measure(app_of(ctx), store_of(ctx), task, sample)
    if as_json:
        emit_json([r.as_dict() for r in results])
        return
    rows = []
    for r in results:
        rec, cur = r.recommended, r.current
        rows.append({
            "task": r.task, "queue": r.queue, "n": r.samples, "p50": age(r.runtime_p50),
            "p95": age(r.runtime_p95), "p99": age(r.runtime_p99), "gap": age(r.heartbeat_gap_p99),
            **{k: _change(cur.get(f"lease_{k}"), rec.get(f"lease_{k}"))
               for k in ("duration", "heartbeat_interval", "grace_period", "max_runtime")},
        })
    echo(table(rows, [("task", "task"), ("queue", "queue"), ("n", "jobs"), ("p50", "p50"),
                            ("p95", "p95"), ("p99", "p99"), ("gap", "heartbeat gap p99"),
                            ("duration", "lease_duration"), ("heartbeat_interval", "heartbeat_interval"),
                            ("grace_period", "grace_period"), ("max_runtime", "max_runtime")],
                     empty="no LeaseTasks and no completed jobs to measure"))
    for r in results:
        for warning in r.warnings:
            echo(f"warning: {r.task}: {warning}")
