"""The pages that only read: overview, jobs and a job, reaper, dead letters; the CLI's report queries."""

from __future__ import annotations

from typing import Any

from flask import Flask, abort, redirect, render_template, request, url_for

import celery_lease.messaging.messages as messages
import celery_lease.ops.recovery as recovery

from ..errors import StoreCorrupt
from ..ops.formats import parse_duration
from ..ops.tuning import percentile
from ..ops.views import (
    FROM_EVENT,
    LAST_HOUR,
    STATUSES,
    aged_reason,
    job_dict,
    job_row,
    job_timeline,
    reaper_status,
    with_ages,
)
from ..store import RUNNING
from ..store.recovery import REVOKED_PREFIX
from ..vocabulary import STALE_WRITES, Event, Status
from .console import Console, console

__all__ = ["register", "overview_data", "job_data", "timeline", "COMPLETED_WINDOW"]

COMPLETED_WINDOW = 3600.0  # seconds of completions the overview counts (history is not counted)
RUNNING_SHOWN = 50
WORKERS_SHOWN = 50
JOBS_LIMIT, JOBS_MAX = 50, 500
DEAD_LETTERS_SHOWN = 100
#: The events whose worker became (or stayed) the job's owner.
OWNERS = (Event.CLAIMED, Event.LEASE_TAKEN_OVER, Event.CLAIM_TAKEN_BACK)


def overview_data(c: Console) -> dict[str, Any]:
    """Everything the overview shows, read in a handful of bounded queries."""
    store = c.store
    now, counts = store.reports.overview_counts(COMPLETED_WINDOW)
    _, running = store.reports.running_rows()
    _, workers = store.reports.list_workers(WORKERS_SHOWN)
    by_queue: dict[str, dict[str, int]] = {}
    for queue, state, n in counts:
        by_queue.setdefault(queue or "", dict.fromkeys(STATUSES, 0))[state] = n
    alive = {w["worker_id"]: w["alive"] for w in workers}
    for row in running:
        row["owner_alive"] = alive.get(row["owner"])
        expires = row["lease_expires_at"]
        row["expired"] = expires is not None and expires < now
    lags = [r["heartbeat_lag"] for r in running if r["heartbeat_lag"] is not None]
    hour = store.reports.event_counts(LAST_HOUR + STALE_WRITES, since=now - 3600)
    return {
        "now": now, "queues": sorted(by_queue.items()),
        "totals": {s: sum(q[s] for q in by_queue.values()) for s in STATUSES},
        "running": running[:RUNNING_SHOWN],
        "running_total": sum(n for _, state, n in counts if state == Status.RUNNING),  # not the rows read
        "expired": [r for r in running if r["expired"]][:RUNNING_SHOWN],
        "expired_total": store.reports.expired_leases(),  # not the rows read
        "lag_max": max(lags, default=None), "lag_p95": percentile(lags, 95),
        "workers": workers, "worker_counts": store.reports.worker_counts(),
        "reaper": reaper_status(c.app, store),
        "recoveries": [(str(name), hour[name]) for name in LAST_HOUR
                       if name != Event.DUPLICATE_DELIVERY_SKIPPED],
        "duplicates": hour[Event.DUPLICATE_DELIVERY_SKIPPED],
        "stale_writes": sum(hour[name] for name in STALE_WRITES),
        "window": COMPLETED_WINDOW,
    }


def timeline(events: list[dict[str, Any]], heartbeat: float | None, start: float,
             end: float) -> list[dict[str, Any]]:
    """Marks on a time axis from ``start`` to ``end``: each event and the last heartbeat (which writes
    no event), with its place in percent and its offset from the start."""
    marks = [{"at": e["at"], "event": e["event"], "worker": e["worker"], "reason": e["reason"],
              "kind": e.get("source", FROM_EVENT)} for e in events]
    if heartbeat is not None:
        marks.append({"at": heartbeat, "event": "last heartbeat", "worker": None, "reason": None,
                      "kind": "heartbeat"})
    # A heartbeat read at the same clock reading as the run's end (a fast job) came before that end.
    ends = {Event.COMPLETED, Event.FAILED, Event.DEAD_LETTERED}
    marks.sort(key=lambda m: (m["at"], 2 if m["event"] in ends else 1 if m["kind"] == "heartbeat" else 0))
    span = end - start
    for m in marks:
        m["offset"] = m["at"] - start
        m["place"] = 50.0 if span <= 0 else round(100.0 * (m["at"] - start) / span, 2)
    return marks


def job_data(c: Console, job_id: str) -> dict[str, Any]:
    """One job: its row, message (arguments hidden unless shown by setting), events on a time axis,
    effect keys and the workers that owned it."""
    store = c.store
    job = store.reports.require(job_id)
    now = store.now()
    history = job_timeline(job, store.reports.list_events(job_id=job.id, limit=1000))
    try:
        sig = messages.decode(job.payload, c.app.conf.accept_content, job.id)
        message: dict[str, Any] = {k: sig.get(k) for k in ("task", "args", "kwargs", "options")}
    except StoreCorrupt as exc:
        message = {"error": str(exc)}
    if not c.show_arguments:
        message = {k: v for k, v in message.items() if k not in ("args", "kwargs")}
    owners: list[dict[str, Any]] = []
    for e in history:
        if e["event"] in OWNERS and e["worker"] and (not owners or owners[-1]["worker"] != e["worker"]):
            owners.append({"worker": e["worker"], "at": e["at"], "event": e["event"]})
    beat = job.last_heartbeat_at
    moments = [job.created_at, *(e["at"] for e in history), *([beat] if beat else [])]
    end = max(moments + ([now] if job.status == RUNNING else []))
    fields = job_dict(job)
    return {"job": job, "fields": fields, "now": now, "events": history, "message": message,
            "arguments_hidden": not c.show_arguments, "effects": store.reports.effect_keys(job.id),
            "owners": owners, "timeline": timeline(history, beat, min(moments), end),
            "start": min(moments), "end": end}


def _jobs_filters() -> tuple[dict[str, Any], str | None]:
    args = request.args
    status = args.get("status") or None
    if status is not None and status not in STATUSES:
        abort(400, f"status must be one of {', '.join(STATUSES)}")
    since_text = (args.get("since") or "").strip()
    error, since = None, None
    if since_text:
        try:
            since = parse_duration(since_text)
        except ValueError as exc:
            error = str(exc)
    try:
        limit = max(1, min(JOBS_MAX, int(args.get("limit") or JOBS_LIMIT)))
    except ValueError:
        limit = JOBS_LIMIT
    filters = {"status": status, "queue": args.get("queue") or None, "task": args.get("task") or None,
               "owner": args.get("owner") or None, "expired": bool(args.get("expired")), "since": since,
               "limit": limit}
    return filters, error


def register(web: Flask) -> None:
    @web.get("/", endpoint="overview")
    def overview() -> str:
        return render_template("overview.html", page="overview", **overview_data(console()))

    @web.get("/overview/live", endpoint="overview_live")
    def overview_live() -> str:
        return render_template("_overview.html", **overview_data(console()))

    @web.get("/jobs", endpoint="jobs")
    def jobs() -> str:
        store = console().store
        filters, error = _jobs_filters()
        found = [] if error else store.reports.list_jobs(**filters)
        now = store.now()
        return render_template("jobs.html", page="jobs", rows=[job_row(j, now) for j in found], error=error,
                               filters=filters, since=request.args.get("since", ""), statuses=STATUSES)

    @web.get("/jobs/<path:job_id>", endpoint="job")
    def job(job_id: str) -> Any:
        c = console()
        resolved = recovery.resolve_job_id(c.store, job_id)
        if resolved != job_id:
            return redirect(url_for("job", job_id=resolved))
        return render_template("job.html", page="jobs", **job_data(c, resolved))

    @web.get("/reaper", endpoint="reaper")
    def reaper() -> str:
        from ..reaper.run import Reaper

        c = console()
        result = Reaper(c.app, c.store).run_once(dry_run=True)
        aged = with_ages(c.store, [d.as_dict() for d in result.planned])
        planned = [{**d, "why": aged_reason(d)} for d in aged]
        return render_template("reaper.html", page="reaper", planned=planned, result=result,
                               status=reaper_status(c.app, c.store), runs=c.store.runs.reaper_runs(20),
                               now=c.store.now())

    @web.get("/dead-letters", endpoint="dead_letters")
    def dead_letters() -> str:
        store = console().store
        task = request.args.get("task") or None
        found = store.recovery.dead_letters(task, DEAD_LETTERS_SHOWN)
        revoked = {j.id for j in found if (j.last_error or "").startswith(REVOKED_PREFIX)}
        return render_template("dead_letters.html", page="dead_letters", jobs=found, revoked=revoked,
                               task=task, now=store.now(), shown=DEAD_LETTERS_SHOWN)
