"""``celery lease check``: a linter over the live app config and the lease store.

``run_checks(app)`` returns one Finding per answer; the rules here cover the lease and the worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..config import app_config, fix_for, problems_of, task_options
from ..errors import LeaseConfigError
from .broker_checks import broker_rules
from .celery_settings import celery_rules
from .check_context import ERROR, OK, WARNING, Context, Finding, Rule, ok_unless
from .checklist import checklist_rules
from .reaper_checks import reaper_rules

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["run_checks", "RULES"]

LONG_TASK = 60.0  # seconds: a task expected to run this long counts as long


def check_policies(ctx: Context) -> Iterator[Finding]:
    for name, exc in ctx.policy_errors.items():
        yield Finding(ERROR, _config_code(exc), (exc.setting,), {"task": name, exc.setting: exc.value},
                      f"task {name}: {exc}", fix_for(exc))
    ratios = {n: round(p.duration / p.heartbeat_interval, 2) for n, p in ctx.policies.items()}
    if not ctx.policy_errors:
        yield Finding(OK, "heartbeat_vs_lease", ("lease_heartbeat_interval", "lease_duration"),
                      {"heartbeats_per_lease": ratios},
                      "every lease outlives at least three heartbeats, so two may fail before it expires")


def check_grace(ctx: Context) -> Iterator[Finding]:
    problems = [
        Finding(WARNING, "grace_vs_heartbeat", ("lease_grace_period", "lease_heartbeat_interval"),
                {"task": n, "lease_grace_period": p.grace_period,
                 "lease_heartbeat_interval": p.heartbeat_interval},
                f"task {n}: a heartbeat that is one interval late (GC pause, slow store, busy CPU) lets the "
                "reaper take a healthy job the moment its lease expires",
                f"set lease_grace_period >= lease_heartbeat_interval ({p.heartbeat_interval:g}s) for {n}")
        for n, p in ctx.policies.items() if p.grace_period < p.heartbeat_interval
    ]
    yield from ok_unless(problems, "grace_vs_heartbeat", ("lease_grace_period", "lease_heartbeat_interval"),
                         {"tasks": len(ctx.policies)}, "every grace period covers one late heartbeat")


def check_time_limits(ctx: Context) -> Iterator[Finding]:
    problems = []
    for task in ctx.tasks:
        policy = ctx.policies.get(task.name)
        limit = ctx.time_limit(task)
        if policy is None:
            continue
        if policy.max_runtime is not None and limit is not None and policy.max_runtime < limit:
            problems.append(Finding(
                WARNING, "max_runtime_vs_time_limit", ("lease_max_runtime", "task_time_limit"),
                {"task": task.name, "lease_max_runtime": policy.max_runtime, "time_limit": limit},
                f"task {task.name}: the heartbeat stops renewing at lease_max_runtime while Celery lets the "
                "body run until time_limit, so the reaper can start a second run beside a live one",
                f"set lease_max_runtime >= time_limit ({limit:g}s) for {task.name}, or lower its time_limit"))
        window = policy.duration + policy.grace_period
        if ctx.pool in ("solo", "gevent", "eventlet") and (limit is None or limit > window):
            problems.append(Finding(
                WARNING, "blocking_heartbeat", ("worker_pool", "task_time_limit", "lease_duration"),
                {"task": task.name, "worker_pool": ctx.pool, "time_limit": limit,
                 "lease_duration": policy.duration, "lease_grace_period": policy.grace_period},
                f"task {task.name}: in the {ctx.pool} pool, blocking code in the body starves the heartbeat; "
                f"its lease then expires after {window:g}s while the body may run "
                f"{'without limit' if limit is None else f'up to {limit:g}s'} and the reaper starts another "
                "run",
                "run it in the prefork or threads pool, or keep every blocking call shorter than "
                "lease_duration (lease.extend(seconds) before a long one)"
                + ("" if ctx.pool == "solo" else f", or set time_limit <= {window:g}s")))
    yield from ok_unless(problems, "time_limit_vs_lease",
                         ("lease_max_runtime", "task_time_limit", "worker_pool"), {"worker_pool": ctx.pool},
                         "the heartbeat runs as long as Celery lets each body run")
    yield from _unenforced_limits(ctx)


UNENFORCING_POOLS = ("threads", "thread", "solo", "eventlet")  # pools that ignore time_limit


def _unenforced_limits(ctx: Context) -> Iterator[Finding]:
    """A pool that never enforces time_limit leaves lease_max_runtime as the only bound."""
    if ctx.pool not in UNENFORCING_POOLS:
        return
    settings = ("lease_max_runtime", "task_time_limit", "worker_pool")
    for task in ctx.tasks:
        if task.name not in ctx.policies or ctx.cfg.policy(task_options(task), ctx.queue(task)).max_runtime:
            continue
        limit = ctx.time_limit(task)
        what = (f"only the lease stops at time_limit ({limit:g}s): it is lost there while the body runs on"
                if limit else "nothing bounds the body: a hung one keeps its lease and its locks for ever")
        yield Finding(
            WARNING, "runtime_limit_unenforced", settings,
            {"task": task.name, "worker_pool": ctx.pool, "time_limit": limit, "lease_max_runtime": None},
            f"task {task.name}: the {ctx.pool} pool does not enforce time limits; {what}",
            f"set lease_max_runtime for {task.name} (past it the lease is lost and the body gets LeaseLost), "
            "or run it in the prefork or gevent pool")


def check_prefetch(ctx: Context) -> Iterator[Finding]:
    multiplier = ctx.conf.worker_prefetch_multiplier
    long_tasks = {}
    for task in ctx.tasks:
        expected, _ = ctx.expected_runtime(task)
        if expected is not None and expected >= LONG_TASK:
            long_tasks[task.name] = expected
    if multiplier > 1 and long_tasks:
        yield Finding(WARNING, "prefetch_long_tasks", ("worker_prefetch_multiplier",),
                      {"worker_prefetch_multiplier": multiplier, "long_tasks": long_tasks},
                      "each process reserves several messages; behind a long task they wait idle while other "
                      "workers starve, and their broker visibility clock keeps running",
                      "set worker_prefetch_multiplier = 1 (and start workers with -O fair)")
    else:
        yield Finding(OK, "prefetch_long_tasks", ("worker_prefetch_multiplier",),
                      {"worker_prefetch_multiplier": multiplier, "long_tasks": long_tasks},
                      "no process reserves messages behind a long task")


def check_acks(ctx: Context) -> Iterator[Finding]:
    early = [t.name for t in ctx.tasks if not ctx.acks_late(t)]
    reject = [t.name for t in ctx.tasks if t.reject_on_worker_lost or (
        t.reject_on_worker_lost is None and ctx.conf.task_reject_on_worker_lost)]
    settings = ("task_acks_late", "task_reject_on_worker_lost")
    values = {"task_acks_late": ctx.conf.task_acks_late,
              "task_reject_on_worker_lost": ctx.conf.task_reject_on_worker_lost}
    problems = []
    if early:
        problems.append(Finding(
            WARNING, "acks_late", settings, {**values, "tasks": early},
            "the message is acknowledged before the job is claimed: if the worker dies in between, only the "
            "reaper's dispatch scan brings it back, after lease_dispatch_timeout "
            f"({ctx.cfg.dispatch_timeout:g}s)",
            "set task_acks_late = True (celery_lease skips the duplicates it lets through)"))
    if reject and set(reject) - set(early):
        problems.append(Finding(
            WARNING, "reject_on_worker_lost", settings, {**values, "tasks": sorted(set(reject) - set(early))},
            "when a pool process dies, the broker requeues the message and celery_lease also recovers the "
            "job from the store: two messages, one skipped as a duplicate, and a job that kills its process "
            "is redelivered without an attempt limit",
            "leave task_reject_on_worker_lost off: celery_lease requeues the job itself, counting attempts"))
    if reject and set(reject) & set(early):
        problems.append(Finding(
            WARNING, "reject_on_worker_lost", settings, {**values, "tasks": sorted(set(reject) & set(early))},
            "task_reject_on_worker_lost has no effect without acks_late",
            "remove task_reject_on_worker_lost, or set task_acks_late = True"))
    yield from ok_unless(problems, "acks_late", settings, values,
                         "messages are acknowledged after the job; celery_lease recovers lost pool processes")


def check_store(ctx: Context) -> Iterator[Finding]:
    url = {"lease_store_url": ctx.store.safe_url}
    error = ctx.store_error
    if error == "not migrated":
        import celery_lease.store.migrations as migrations

        oldest, newest = migrations.supported()
        yield Finding(ERROR, "store_migrated", ("lease_store_url", "lease_table_prefix"),
                      {**url, "lease_table_prefix": ctx.cfg.table_prefix, "revision": ctx.revision,
                       "supported": f"{oldest}..{newest}"},
                      f"workers cannot record or claim jobs: {ctx.schema_problem}",
                      "run `celery -A proj lease migrate` (a worker start creates an empty store, "
                      "never upgrades one)")
        return
    if error:
        yield Finding(ERROR, "store_reachable", ("lease_store_url",), url, "the lease store cannot be "
                                                                           "reached: "
                      f"{error}; tasks will not run without it (fail closed)",
                      "check lease_store_url and that the database is running and reachable from every "
                      "worker")
        return
    yield Finding(OK, "store_reachable", ("lease_store_url", "lease_table_prefix"),
                  {**url, "lease_table_prefix": ctx.cfg.table_prefix, "revision": ctx.revision},
                  f"the store answers, at schema revision {ctx.revision}")
    hosts = sorted({h.rsplit("@", 1)[-1] for h in ctx.facts["hosts"]})
    if ctx.store.dialect.local_file:
        values = {**url, "worker_hosts": hosts}
        if len(hosts) > 1:
            yield Finding(ERROR, "sqlite_multi_host", ("lease_store_url",), values,
                          "workers on several hosts each see their own SQLite file (or corrupt a shared "
                          "network file): leases are not shared, so two hosts can run the same job",
                          "use PostgreSQL or MySQL/MariaDB for lease_store_url")
        else:
            yield Finding(OK, "sqlite_multi_host", ("lease_store_url",), values,
                          "all registered workers run on one host, which SQLite supports")


RULES: tuple[Rule, ...] = (check_policies, check_grace, check_time_limits, check_prefetch, check_acks,
                           reaper_rules, check_store, broker_rules, celery_rules, checklist_rules)


def _config_code(problem: LeaseConfigError) -> str:
    return "heartbeat_vs_lease" if problem.setting == "lease_heartbeat_interval" else "config_invalid"


def run_checks(app: Any, store: Store | None = None, pool: str | None = None) -> list[Finding]:
    """Every finding for an app: its config, its tasks, its broker and its store."""
    try:
        cfg = app_config(app)
    except LeaseConfigError as exc:
        return [Finding(ERROR, _config_code(p), (p.setting,), {p.setting: p.value}, str(p), fix_for(p))
                for p in problems_of(exc)]
    if store is None:
        from ..store import for_app

        store = for_app(app, check=False)
    ctx = Context(app, cfg, store, pool)
    findings: list[Finding] = []
    for rule in RULES:
        findings.extend(rule(ctx))
    return findings
