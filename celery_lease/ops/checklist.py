"""The seeds' operational checklist, answered from the live config and the lease store.

Where only the code can tell (which job is sensitive), the answer asks the question as a warning.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from ..config import SCRAPE_FRESH
from ..errors import StoreRejected, StoreUnavailable
from ..store.runs import EXPORTER_SCRAPE
from .check_context import ERROR, OK, RECOVERY_EVENTS, WARNING, Context, Finding, ok_unless
from .tuning import percentile

__all__ = ["checklist_rules"]

MIN_SAMPLE = 1  # finished runs needed before a p99 is reported


def checklist_rules(ctx: Context) -> Iterator[Finding]:
    for rule in (_durations, _timeouts_vs_p99, _plain_tasks, _idempotency, _locks, _backoff, _dead_letter,
                 _dashboards, _crash_tested):
        yield from rule(ctx)


def _durations(ctx: Context) -> Iterator[Finding]:
    if ctx.store_error:
        yield Finding(WARNING, "durations_measured", ("lease_store_url",), {"store": ctx.store_error},
                      "run times cannot be read while the store is unavailable", "fix the store first")
        return
    measured, unmeasured = {}, []
    for task in ctx.tasks:
        sample = ctx.durations.get(task.name, [])
        if len(sample) < MIN_SAMPLE:
            unmeasured.append(task.name)
        else:
            measured[task.name] = {"runs": len(sample), "p50": percentile(sample, 50),
                                   "p95": percentile(sample, 95), "p99": percentile(sample, 99)}
    if unmeasured:
        yield Finding(WARNING, "durations_measured", (), {"unmeasured": unmeasured, "measured": measured},
                      "no finished run in the store: their p99 is unknown, so no timeout can be checked "
                      "against the tail of their run times",
                      "let them run (staging or production), then run `celery lease check` and `celery lease "
                      "tune`")
    else:
        yield Finding(OK, "durations_measured", (), {"measured": measured},
                      "every LeaseTask has measured run times")


def _timeouts_vs_p99(ctx: Context) -> Iterator[Finding]:
    if ctx.store_error:  # no run time was read: nothing to vouch for (durations_measured says why)
        return
    problems = []
    for task in ctx.tasks:
        p99 = ctx.p99(task)
        policy = ctx.policies.get(task.name)
        if p99 is None or policy is None:
            continue
        limits = [("time_limit", ctx.time_limit(task), ERROR),
                  ("soft_time_limit", task.soft_time_limit or ctx.conf.task_soft_time_limit, WARNING)]
        if policy.max_runtime is not None and policy.max_runtime != ctx.time_limit(task):
            limits.append(("lease_max_runtime", policy.max_runtime, ERROR))  # set on its own
        for setting, limit, level in limits:
            if limit and limit < p99:
                problems.append(Finding(
                    level, "timeout_vs_p99", (setting,),
                    {"task": task.name, setting: float(limit), "p99": p99},
                    f"task {task.name}: 1% of its runs take longer than {setting} ({limit:g}s < p99 "
                    f"{p99:g}s); those runs are cut short or lose their lease while healthy",
                    f"raise {setting} above the p99 ({p99:g}s) with room for the tail, or split the task"))
    yield from ok_unless(problems, "timeout_vs_p99", ("task_time_limit", "task_soft_time_limit",
                                                      "lease_max_runtime"),
                         {"tasks_measured": sum(1 for t in ctx.tasks if ctx.p99(t) is not None)},
                         "every time limit is above the measured p99")


def _plain_tasks(ctx: Context) -> Iterator[Finding]:
    names = [t.name for t in ctx.plain]
    if names:
        yield Finding(WARNING, "heartbeat_for_long_jobs", ("task_cls",), {"plain_tasks": names},
                      "these tasks run without a lease or heartbeat: if one runs long, the broker "
                      "re-delivers it and two workers run it; if its worker dies, nothing recovers it",
                      "declare long or important tasks with base=LeaseTask (or set the app's task_cls)")
    else:
        yield Finding(OK, "heartbeat_for_long_jobs", ("task_cls",), {"lease_tasks": len(ctx.tasks)},
                      "every task runs under a heartbeat-renewed lease")


def _idempotency(ctx: Context) -> Iterator[Finding]:
    if ctx.store_error:
        return
    bare = [t.name for t in ctx.tasks
            if ctx.task_facts(t).get("jobs") and not (ctx.task_facts(t).get("keyed")
                                                      or ctx.task_facts(t).get("effects"))]
    yield from ok_unless(
        [Finding(WARNING, "idempotency", (), {"tasks": bare},
                 "these tasks ran without an idempotency key or a recorded effect: a retried or taken-over "
                 "run repeats whatever side effects the first one had (payments, stock, e-mails)",
                 "for each side effect, `with self.lease.effect(key) as first:` (or publish with "
                 "apply_async(idempotency_key=...)); ignore this for tasks without side "
                 "effects")] if bare else [],
        "idempotency", (), {"tasks": {t.name: {k: ctx.task_facts(t).get(k, 0) for k in ("keyed", "effects")}
                                      for t in ctx.tasks}},
        "every task that ran used idempotency keys or recorded effects")


def _calls(task: Any, name: str) -> bool:
    try:
        return f".{name}(" in inspect.getsource(task.run)
    except (OSError, TypeError):
        return False


def _locks(ctx: Context) -> Iterator[Finding]:
    users = sorted({t.name for t in ctx.tasks if _calls(t, "lock") or ctx.task_facts(t).get("locks")})
    if users or not ctx.tasks:
        yield Finding(OK, "locks", ("lease_lock_ttl",), {"tasks_using_locks": users},
                      "critical resources are locked by these tasks (celery_lease cannot tell which are "
                      "critical)")
    else:
        yield Finding(WARNING, "locks", ("lease_lock_ttl",), {"tasks_using_locks": users},
                      "no task takes a resource lock: two different jobs on the same account or order can "
                      "run at once (a lease covers one job, not a resource)",
                      "wrap critical sections in `with self.lease.lock(f'account:{id}'):`; ignore this if no "
                      "resource is shared")


def _backoff(ctx: Context) -> Iterator[Finding]:
    problems = []
    for task in ctx.tasks:
        policy = ctx.policies.get(task.name)
        if policy is not None and (policy.backoff_base == 0 or policy.backoff_max == 0):
            problems.append(Finding(
                WARNING, "backoff", ("lease_backoff_base", "lease_backoff_max"),
                {"task": task.name, "lease_backoff_base": policy.backoff_base,
                 "lease_backoff_max": policy.backoff_max},
                f"task {task.name}: an expired job is requeued at once, so a job that keeps failing its "
                "lease loops without a pause and hammers a struggling dependency",
                "set lease_backoff_base > 0 (e.g. 1.0) and lease_backoff_max > it"))
        delay = task.default_retry_delay or 0
        if getattr(task, "autoretry_for", ()) and not getattr(task, "retry_backoff", False) and delay < 1:
            problems.append(Finding(
                WARNING, "backoff", ("retry_backoff", "default_retry_delay"),
                {"task": task.name, "retry_backoff": False, "default_retry_delay": delay},
                f"task {task.name}: autoretry re-runs a failure after {delay:g}s with no backoff: a fast "
                "retry loop while a dependency is down",
                "set retry_backoff=True (and retry_jitter) on the task, or a default_retry_delay of seconds"))
    yield from ok_unless(problems, "backoff", ("lease_backoff_base", "retry_backoff"),
                         {"lease_backoff_base": ctx.cfg.backoff_base,
                          "lease_backoff_max": ctx.cfg.backoff_max},
                         "requeues and retries back off exponentially")


def _dead_letter(ctx: Context) -> Iterator[Finding]:
    problems = []
    consumed = {ctx.queue(t) for t in ctx.tasks} | {ctx.conf.task_default_queue}
    for task in ctx.tasks:
        policy = ctx.policies.get(task.name)
        if policy is not None and policy.dead_letter_queue in consumed:
            problems.append(Finding(
                WARNING, "dead_letter", ("lease_dead_letter_queue",),
                {"task": task.name, "lease_dead_letter_queue": policy.dead_letter_queue},
                f"task {task.name}: its dead-letter queue {policy.dead_letter_queue!r} is a queue its "
                "workers consume: dead jobs come straight back to them (and are skipped as finished)",
                "use a queue no worker consumes, e.g. 'dead_letter', and inspect it with `celery lease dlq "
                "list`"))
    if ctx.store_error:  # whether any is waiting was not read: the config findings only
        yield from problems
        return
    # Every task name in the store: a removed task's dead letters wait too (`dlq discard` is for them).
    failed = {name: facts["failed"] for name, facts in ctx.facts["tasks"].items() if facts.get("failed")}
    if failed:
        problems.append(Finding(
            WARNING, "dead_letter", ("lease_dead_letter_queue",), {"failed_jobs": failed},
            "jobs are dead-lettered (failed for good) and wait for an operator",
            "inspect them with `celery lease dlq list`, fix the cause, then `celery lease dlq redrive`"))
    yield from ok_unless(problems, "dead_letter", ("lease_dead_letter_queue", "lease_max_attempts"),
                         {"lease_dead_letter_queue": ctx.cfg.dead_letter_queue,
                          "lease_max_attempts": ctx.cfg.max_attempts},
                         "jobs that exhaust their attempts are dead-lettered, none is waiting; "
                         "`celery lease dlq list` shows them")


def _dashboards(ctx: Context) -> Iterator[Finding]:
    if ctx.store_error:
        return
    hint = ("pip install celery-lease[metrics], run `celery -A proj lease exporter`, have Prometheus "
            "scrape it, and load celery_lease/contrib/prometheus/alerts.yml and the Grafana dashboard "
            "celery_lease/contrib/grafana/celery_lease.json")
    try:
        age, exporter = ctx.store.runs.meta_age(EXPORTER_SCRAPE)
    except (StoreUnavailable, StoreRejected):
        return
    values = {"last_scrape_age": None if age is None else round(age, 1), "exporter": exporter}
    if age is None:
        yield Finding(WARNING, "dashboards", (), values,
                      "no exporter scrape is recorded in this store: backlog, age of the oldest job, "
                      "retries and lease expirations are seen only when users complain", hint)
    elif age > SCRAPE_FRESH:
        yield Finding(WARNING, "dashboards", (), values,
                      f"the exporter was last scraped {age:.0f}s ago: nothing watches the metrics now",
                      "check that `celery -A proj lease exporter` runs and that Prometheus scrapes it")
    else:
        yield Finding(OK, "dashboards", (), values,
                      f"an exporter ({exporter}) was scraped {age:.0f}s ago")


def _crash_tested(ctx: Context) -> Iterator[Finding]:
    if ctx.store_error:
        return
    try:
        counts = ctx.store.reports.event_counts(RECOVERY_EVENTS)
    except (StoreUnavailable, StoreRejected):
        return
    if any(counts.values()):
        yield Finding(OK, "crash_tested", (), {"recoveries": counts},
                      "this store has recovered jobs from crashed or lost workers")
    else:
        yield Finding(WARNING, "crash_tested", (), {"recoveries": counts},
                      "no recovery from a crash before ack is recorded in this store: the recovery path has "
                      "not been seen working here",
                      "in staging, `kill -9` a worker in the middle of a job and watch it complete once "
                      "(`celery lease events`)")

