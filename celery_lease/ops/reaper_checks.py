"""`lease check` rules about the reaper: is it scheduled, routed apart, and seen running?"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
from collections.abc import Iterator
from typing import Any

from ..config import REAPER_OVERDUE_INTERVALS, worker_stale_after
from ..errors import StoreUnavailable
from .check_context import ERROR, OK, WARNING, Context, Finding

__all__ = ["ReaperEntry", "reaper_entries", "reaper_rules", "REAP_TASK"]

REAP_TASK = "celery_lease.reap"
# The schedule the hints suggest and ``manage.py lease_schedule_reaper`` writes.
REAPER_ENTRY = "lease-reaper"
REAPER_INTERVAL = 15  # seconds between runs
REAPER_QUEUE = "lease-maintenance"
REAPER_EXPIRES = 10  # seconds: a run still queued after this is dropped, below the interval
SUGGESTED = (f"{{'{REAPER_ENTRY}': {{'task': '{REAP_TASK}', 'schedule': {REAPER_INTERVAL:.1f}, "
             f"'options': {{'queue': '{REAPER_QUEUE}', 'expires': {REAPER_EXPIRES:.1f}}}}}}}")
# django-celery-beat's admin labels for the fields the routing rule reads.
ADMIN_FIELDS = "Execution Options: \"Queue Override\" and \"Expires timedelta with seconds\""
SCHEDULE_COMMAND = "python manage.py lease_schedule_reaper"


@dataclasses.dataclass(frozen=True)
class ReaperEntry:
    """One schedule entry that runs the reaper: where it is held, how often, where it goes."""

    name: str
    source: str  # "beat_schedule" or "django_celery_beat"
    interval: float | None  # seconds; None when the schedule is not a fixed interval (crontab)
    queue: str | None
    expires: float | None


def _seconds(schedule: Any) -> float | None:
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return float(schedule)
    if isinstance(schedule, datetime.timedelta):
        return schedule.total_seconds()
    run_every = getattr(schedule, "run_every", None)  # celery.schedules.schedule
    return run_every.total_seconds() if isinstance(run_every, datetime.timedelta) else None


def _beat_entries(app: Any) -> Iterator[ReaperEntry]:
    for name, entry in (app.conf.beat_schedule or {}).items():
        if entry.get("task") != REAP_TASK:
            continue
        options = dict(entry.get("options") or {})
        queue = app.amqp.router.route(options, REAP_TASK).get("queue")
        expires = options.get("expires")
        yield ReaperEntry(name, "beat_schedule", _seconds(entry.get("schedule")),
                          getattr(queue, "name", queue), _seconds(expires))


def _django_entries(app: Any) -> tuple[list[ReaperEntry], str | None]:
    """django-celery-beat's enabled PeriodicTask rows for the reaper, and why they could not be read."""
    if importlib.util.find_spec("django_celery_beat") is None or importlib.util.find_spec("django") is None:
        return [], None
    from django.conf import settings

    if not settings.configured:
        return [], None
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()
    if not apps.is_installed("django_celery_beat"):
        return [], None
    from django.db import DatabaseError
    from django_celery_beat.models import PeriodicTask

    try:
        rows = list(PeriodicTask.objects.filter(task=REAP_TASK, enabled=True)
                    .select_related("interval", "crontab"))
    except DatabaseError as exc:
        return [], f"django_celery_beat's tables cannot be read: {exc}"
    entries = []
    for row in rows:
        interval = row.interval.schedule.run_every.total_seconds() if row.interval else None
        options = {"queue": row.queue} if row.queue else {}
        queue = app.amqp.router.route(options, REAP_TASK).get("queue")
        entries.append(ReaperEntry(row.name, "django_celery_beat", interval, getattr(queue, "name", queue),
                                   float(row.expire_seconds) if row.expire_seconds else None))
    return entries, None


def reaper_entries(app: Any) -> tuple[list[ReaperEntry], str | None]:
    """Every schedule entry that runs the reaper, and why a scheduler could not be read (or None)."""
    django_entries, problem = _django_entries(app)
    return [*_beat_entries(app), *django_entries], problem


def _work_queues(ctx: Context) -> set[str]:
    queues = {str(ctx.conf.task_default_queue or "celery")}
    return queues | {q for q in (ctx.queue(t) for t in ctx.tasks) if q}


def _routing(ctx: Context, entries: list[ReaperEntry]) -> Iterator[Finding]:
    shared = _work_queues(ctx)
    problems, faulty = [], set()
    for e in entries:
        found = []
        if e.queue is None or e.queue in shared:
            found.append(f"{e.name} ({e.source}) goes to the work queue {e.queue or 'celery'!r}")
        if e.expires is None:
            found.append(f"{e.name} ({e.source}) has no expires")
        elif e.interval is not None and e.expires >= e.interval:
            found.append(f"{e.name} ({e.source}) expires after {e.expires:g}s, not below its "
                         f"{e.interval:g}s interval")
        problems += found
        faulty |= {e.source} if found else set()
    values = {"entries": [dataclasses.asdict(e) for e in entries]}
    if problems:
        yield Finding(WARNING, "reaper_routing", ("beat_schedule",), {**values, "problems": problems},
                      "a reaper on a work queue waits behind the backlog it should rescue, and runs without "
                      "expires pile up while no worker consumes them, then fire at once",
                      _routing_fix(faulty))
    else:
        yield Finding(OK, "reaper_routing", ("beat_schedule",), values,
                      "the reaper has a queue of its own and its runs expire before the next one")


def _interval(ctx: Context, entries: list[ReaperEntry]) -> Iterator[Finding]:
    """The reaper's clock guard tells a step of the store's clock from a gap between runs on two hosts only
    by the gap's length: runs further apart than lease_worker_stale_after let a forward step hide in one."""
    fixed = [e.interval for e in entries if e.interval]
    if not fixed:
        return
    every, stale = min(fixed), worker_stale_after(ctx.app)
    values = {"interval": every, "lease_worker_stale_after": stale}
    if every > stale:
        yield Finding(WARNING, "reaper_interval", ("beat_schedule", "lease_worker_stale_after"), values,
                      f"the reaper runs every {every:g}s, further apart than lease_worker_stale_after "
                      f"({stale:g}s): a forward step of the store's clock between two runs on different "
                      "hosts looks like the usual gap, and a live owner's job can be taken back",
                      f"run the reaper at least every {stale:g}s (its schedule entry), or raise "
                      "lease_worker_stale_after")
    else:
        yield Finding(OK, "reaper_interval", ("beat_schedule",), values,
                      "the reaper runs at least every lease_worker_stale_after: a step of the store's "
                      "clock between two runs is told from the usual gap")


def _routing_fix(sources: set[str]) -> str:
    fixes = []
    if "beat_schedule" in sources:
        fixes.append("route the reaper to a queue of its own with expires below its interval, e.g. "
                     + SUGGESTED)
    if "django_celery_beat" in sources:
        fixes.append(f"in django-celery-beat's admin (Periodic tasks, the reaper's entry, {ADMIN_FIELDS}) "
                     f"set a queue of its own and expiry seconds below the interval, or run "
                     f"`{SCHEDULE_COMMAND}`, which sets both (queue {REAPER_QUEUE!r}, every "
                     f"{REAPER_INTERVAL}s, expires {REAPER_EXPIRES}s)")
    return "; ".join(fixes) + f", and run a worker with -Q {REAPER_QUEUE}"


def _scheduled_fix(conf: Any) -> str:
    if "django_celery_beat" in str(conf.beat_scheduler or ""):
        return (f"run `{SCHEDULE_COMMAND}` (it creates the reaper's periodic task with its queue and "
                f"expiry), or add it in django-celery-beat's admin, and run celery beat")
    return (f"add {{'{REAPER_ENTRY}': {{'task': '{REAP_TASK}', 'schedule': {REAPER_INTERVAL:.1f}}}}} to "
            "beat_schedule and run celery beat")


def _running(ctx: Context, entries: list[ReaperEntry]) -> Iterator[Finding]:
    if ctx.store_error:
        return
    try:
        now, run = ctx.store.runs.last_reaper_run()
    except StoreUnavailable:
        return
    intervals = [e.interval for e in entries if e.interval]
    interval = min(intervals) if intervals else None
    if run is None:
        if not entries:
            return  # reaper_scheduled already says that nothing runs it
        yield Finding(WARNING, "reaper_running", ("beat_schedule",), {"last_run": None, "interval": interval},
                      "no reaper run is recorded in this store: it is scheduled but has never run (is "
                      "celery beat running, and a worker consuming its queue?)",
                      "run celery beat and a worker that consumes the reaper's queue; "
                      "`celery -A proj lease reap` runs one cycle now")
        return
    age = max(0.0, now - float(run["finished_at"]))
    values = {"last_run_age": round(age, 1), "interval": interval, "worker": run["worker"],
              "duration": run["duration"], "counts": run["counts"]}
    if interval is not None and age > REAPER_OVERDUE_INTERVALS * interval:
        yield Finding(ERROR, "reaper_running", ("beat_schedule",), values,
                      f"the reaper last ran {age:.0f}s ago, more than {REAPER_OVERDUE_INTERVALS} of its "
                      f"{interval:g}s intervals: abandoned leases are not being taken back",
                      "check celery beat and the worker that consumes the reaper's queue "
                      "(`celery -A proj lease status` shows the last run)")
    else:
        yield Finding(OK, "reaper_running", ("beat_schedule",), values,
                      f"the reaper last ran {age:.0f}s ago")


def reaper_rules(ctx: Context) -> Iterator[Finding]:
    entries, problem = reaper_entries(ctx.app)
    if entries:
        yield Finding(OK, "reaper_scheduled", ("beat_schedule",),
                      {"entries": {e.name: e.interval for e in entries},
                       "sources": sorted({e.source for e in entries})},
                      "celery beat runs the reaper that takes back abandoned leases")
        yield from _routing(ctx, entries)
        yield from _interval(ctx, entries)
    else:
        values: dict[str, Any] = {"beat_schedule": sorted(ctx.conf.beat_schedule or {})}
        if problem:
            values["django_celery_beat"] = problem
        yield Finding(ERROR, "reaper_scheduled", ("beat_schedule",), values,
                      "nothing takes back the lease of a job whose worker died, or re-sends a job whose "
                      "message vanished: such jobs stay running or pending forever",
                      _scheduled_fix(ctx.conf))
    yield from _running(ctx, entries)
