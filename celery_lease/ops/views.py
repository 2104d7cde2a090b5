"""Jobs, events, plans and the reaper's state as rows an operator reads, for the CLI and the web page
(here so the page never imports the CLI)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from ..store import RUNNING, Job
from ..store.attempts import PREVIOUS_OWNER, PREVIOUS_STARTED_AT, PREVIOUS_TOKEN
from ..vocabulary import MANUAL_RECOVERIES, Decision, Event, Status, TimelineSource
from .formats import age

__all__ = ["STATUSES", "LAST_HOUR", "job_dict", "event_dict", "job_row", "reaper_status", "job_plan",
           "with_ages", "aged_reason", "job_timeline", "FROM_ROW", "FROM_EVENT"]

STATUSES = tuple(s.value for s in Status)
LAST_HOUR = (Event.REAPED_EXPIRED_LEASE, Event.DUPLICATE_DELIVERY_SKIPPED, Event.DEAD_LETTERED,
             Event.REDISPATCHED, Event.RELEASED_ON_SHUTDOWN, *MANUAL_RECOVERIES)


def _parsed(text: str | None) -> Any:
    """A stored JSON text as the object it holds (for --json output); text that is not JSON as it is."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def job_dict(job: Job, payload: bool = False) -> dict[str, Any]:
    """A job for --json: its checkpoint as the object it stores, not a JSON string."""
    data = dataclasses.asdict(job)
    data.update(checkpoint=_parsed(job.checkpoint))
    if not payload:
        data.pop("payload")
    return data


# Where a timeline entry comes from: a stored event, or the job's row (a first claim and its
# completion write no event unless lease_audit_every_transition).
FROM_EVENT, FROM_ROW = TimelineSource.EVENT, TimelineSource.ROW
# The events whose worker became (or stayed) the job's owner: each one starts an attempt.
_STARTS = (Event.CLAIMED, Event.LEASE_TAKEN_OVER, Event.CLAIM_TAKEN_BACK)
# The events that end or change a job's completion (a replacement completes it without a completion).
_FINISHES = (Event.COMPLETED, Event.REPLACED)


def _detail(e: dict[str, Any]) -> dict[str, Any]:
    detail = e.get("detail")
    parsed = _parsed(detail) if isinstance(detail, str) else detail
    return parsed if isinstance(parsed, dict) else {}


def _row_entry(job_id: str, event: Event, at: float, worker: str | None, token: str | None,
               reason: str) -> dict[str, Any]:
    return {"id": None, "job_id": job_id, "event": str(event), "reason": reason, "worker": worker,
            "token": token, "at": at, "detail": None, "source": FROM_ROW}


def _attempts(job: Job | None, stored: list[dict[str, Any]]) -> dict[float, dict[str, Any]]:
    """Every attempt's start the row or a decision's event records: start -> (owner, token, by what)."""
    found: dict[float, dict[str, Any]] = {}
    for n, e in enumerate(stored):
        detail = _detail(e)
        if detail.get(PREVIOUS_STARTED_AT) is None:
            continue
        began = float(detail[PREVIOUS_STARTED_AT])
        # A retry or release cleared the owner before the decision read it: its own event names it.
        owner = detail.get(PREVIOUS_OWNER) or next(
            (x["worker"] for x in reversed(stored[:n]) if x["worker"] and x["at"] >= began), None)
        found.setdefault(began, {"owner": owner, "token": detail.get(PREVIOUS_TOKEN),
                                 "by": f"recorded by {e['event']}"})
    if job is not None and job.started_at is not None:
        found.setdefault(job.started_at, {"owner": job.locked_by, "token": (job.lock_token or "")[:8] or None,
                                          "by": "the job's row"})
    return found


def job_timeline(job: Job | None, events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A job's stored events and the claims and completion its row records, in time order, each
    marked with its ``source``; an attempt (from the row or a decision's detail) that no stored event
    claimed is listed as a claim from the row."""
    stored = [{**e, "source": FROM_EVENT} for e in events]
    job_id = job.id if job is not None else (stored[0]["job_id"] if stored else "")
    attempts = _attempts(job, stored)
    starts = sorted(attempts)
    derived: list[dict[str, Any]] = []
    for n, began in enumerate(starts):
        after = starts[n + 1] if n + 1 < len(starts) else float("inf")
        if not any(e["event"] in _STARTS and began <= e["at"] < after for e in stored):
            a = attempts[began]
            derived.append(_row_entry(job_id, Event.CLAIMED, began, a["owner"], a["token"],
                                      f"claim ({a['by']})"))
    if job is not None and job.status == Status.COMPLETED and job.completed_at is not None and not any(
            e["event"] in _FINISHES and e["at"] >= (job.started_at or 0.0) for e in stored):
        derived.append(_row_entry(job_id, Event.COMPLETED, job.completed_at, job.locked_by, None,
                                  "completion (the job's row)"))
    return sorted(stored + derived, key=lambda e: e["at"])


def event_dict(e: dict[str, Any]) -> dict[str, Any]:
    """An audit event for --json: its detail as an object."""
    return {**e, "detail": _parsed(e.get("detail"))}


def _lease_text(job: Job, now: float) -> str:
    if job.status != RUNNING or job.lease_expires_at is None:
        return ""
    left = job.lease_expires_at - now
    return f"expires in {age(left)}" if left >= 0 else f"EXPIRED {age(-left)} ago"


def job_row(job: Job, now: float) -> dict[str, Any]:
    beat = job.last_heartbeat_at if job.status == RUNNING else None
    return {"id": job.id, "task": job.task_name, "queue": job.queue_name, "status": job.status,
            "attempts": f"{job.attempt_count}/{job.max_attempts}", "lease": _lease_text(job, now),
            "owner": job.locked_by if job.status == RUNNING else None,
            "heartbeat": f"{age(now - beat)} ago" if beat is not None else None,
            "updated": f"{age(now - job.updated_at)} ago"}


def reaper_status(app: Any, store: Any) -> dict[str, Any]:
    """The reaper's last recorded run against its schedule (beat_schedule, django-celery-beat)."""
    from ..config import REAPER_OVERDUE_INTERVALS
    from .reaper_checks import reaper_entries

    entries, _ = reaper_entries(app)
    intervals = [e.interval for e in entries if e.interval]
    interval = min(intervals) if intervals else None
    now, run = store.runs.last_reaper_run()
    if run is None:
        return {"interval": interval, "last_run": None, "summary": "no run recorded" + (
            f" (scheduled every {interval:g}s)" if interval else " (not scheduled)")}
    since = now - float(run["finished_at"])
    late = interval is not None and since > REAPER_OVERDUE_INTERVALS * interval
    summary = (f"last run {age(since)} ago on {run['worker']}, took {run['duration']:.2f}s"
               + (f" (every {interval:g}s)" if interval else " (not scheduled)")
               + (" - NOT RUNNING" if late else ""))
    return {"interval": interval, "last_run": {**run, "age": since}, "overdue": late, "summary": summary}


def job_plan(store: Any, jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """Plan rows of jobs, in ages: since the lease expired or the job failed, since its owner was seen."""
    now, seen = store.reports.workers_last_seen(sorted({j.locked_by for j in jobs if j.locked_by}))
    rows = []
    for j in jobs:
        why = []
        if j.status == RUNNING and j.lease_expires_at is not None:
            left = j.lease_expires_at - now
            why.append(f"lease expired {age(-left)} ago" if left < 0 else f"lease valid for {age(left)}")
        if j.locked_by and j.status == RUNNING:
            last = seen.get(j.locked_by)
            why.append(f"owner {j.locked_by} " + ("never registered" if last is None
                                                   else f"last seen {age(now - last)} ago"))
        if j.failed_at is not None:
            why.append(f"failed {age(now - j.failed_at)} ago: {j.last_error or ''}")
        rows.append({"job_id": j.id, "task": j.task_name, "queue": j.queue_name, "status": j.status,
                     "attempts": f"{j.attempt_count}/{j.max_attempts}", "why": "; ".join(why)})
    return rows


def with_ages(store: Any, planned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Planned decisions with seconds since each lease expired and since its owner was last seen."""
    if not planned:
        return planned
    now, seen = store.reports.workers_last_seen(sorted({d["owner"] for d in planned if d.get("owner")}))
    out = []
    for d in planned:
        job = store.get(d["job_id"])
        expires = job.lease_expires_at if job is not None else None
        last = seen.get(d.get("owner") or "")
        out.append({**d, "lease_expired_ago": None if expires is None else now - expires,
                    "owner_last_seen_ago": None if last is None else now - last})
    return out


def aged_reason(d: dict[str, Any]) -> str:
    """The reaper's reason in ages: how long ago the lease expired and its owner was last seen."""
    ages = []
    if d.get("lease_expired_ago") is not None:
        ages.append(f"lease expired {age(d['lease_expired_ago'])} ago")
    if d.get("owner"):
        last = d.get("owner_last_seen_ago")
        ages.append(f"owner last seen {age(last)} ago" if last is not None else "owner never registered")
    if d["decision"] == Decision.SKIP_OWNER_ALIVE:
        return ", ".join(ages) + ": waiting for the hard grace"
    return f"{d['reason']} ({', '.join(ages)})" if ages else d["reason"]
