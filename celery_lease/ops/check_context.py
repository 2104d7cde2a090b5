"""What every ``lease check`` rule reads (the Context) and answers (the Finding)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import celery_lease.worker.brokers as brokers

from ..config import AppConfig, TaskPolicy, task_policy
from ..errors import LeaseConfigError, SchemaMismatch, StoreRejected, StoreUnavailable
from ..vocabulary import RECOVERIES, Severity
from .tuning import percentile

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["Finding", "Context", "Rule", "ok_unless", "ERROR", "WARNING", "OK",
           "RECOVERY_EVENTS"]

ERROR, WARNING, OK = Severity.ERROR, Severity.WARNING, Severity.OK
RECOVERY_EVENTS = RECOVERIES


@dataclasses.dataclass(frozen=True)
class Finding:
    """One answer of the linter: level, code, settings and values, why, fix."""

    level: Severity
    code: str
    settings: tuple[str, ...]
    values: Mapping[str, Any]
    why: str
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (values that JSON cannot carry become their repr)."""
        return {"level": str(self.level), "code": self.code, "settings": list(self.settings),
                "values": {k: _plain(v) for k, v in self.values.items()}, "why": self.why, "fix": self.fix}


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return str(value)  # a vocabulary member as its name, as text and JSON show it
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return repr(value)


class Context:
    """What the rules read, each piece computed once: config, tasks, store facts, broker."""

    def __init__(self, app: Any, cfg: AppConfig, store: Store, pool: str | None = None) -> None:
        from ..integration.task import LeaseTask

        self.app, self.conf, self.cfg, self.store = app, app.conf, cfg, store
        self._pool = pool
        named = sorted(app.tasks.items())
        # Celery's own tasks (chord_unlock, backend_cleanup, map...) are LeaseTasks in an app whose task_cls
        # is LeaseTask: not the app's to measure or bound.
        self.tasks = [t for name, t in named if isinstance(t, LeaseTask) and not name.startswith("celery.")]
        self.plain = [t for name, t in named if not isinstance(t, LeaseTask)
                      and not name.startswith(("celery.", "celery_lease."))]
        self.policies: dict[str, TaskPolicy] = {}
        self.policy_errors: dict[str, LeaseConfigError] = {}
        self.revision: str | None = None
        self.schema_problem = ""
        for task in self.tasks:
            try:
                self.policies[task.name] = task_policy(task, self.queue(task))
            except LeaseConfigError as exc:
                self.policy_errors[task.name] = exc

    def queue(self, task: Any) -> str | None:
        queue = getattr(task, "queue", None)
        route = self.app.amqp.router.route({"queue": queue} if queue else {}, task.name)
        queue = route.get("queue")
        return getattr(queue, "name", queue)

    @functools.cached_property
    def transport(self) -> str:
        return brokers.transport_kind(self.app)

    @functools.cached_property
    def registered_pool(self) -> str | None:
        """The pool most live workers record in the registry, or None."""
        if self.store is None or self.store_error:
            return None
        try:
            pools = self.store.reports.worker_pools()
        except (StoreUnavailable, StoreRejected):
            return None
        return max(pools, key=lambda name: pools[name]) if pools else None

    @property
    def pool(self) -> str:
        """The pool the check was told, else the one live workers run, else the app's worker_pool."""
        chosen = self._pool or self.registered_pool or self.conf.worker_pool or "prefork"
        return str(chosen).rsplit(":", 1)[-1].lower()

    def time_limit(self, task: Any) -> float | None:
        limit = task.time_limit if task.time_limit is not None else self.conf.task_time_limit
        return float(limit) if limit else None

    def acks_late(self, task: Any) -> bool:
        return bool(task.acks_late if task.acks_late is not None else self.conf.task_acks_late)

    @functools.cached_property
    def store_error(self) -> str | None:
        """Why the store cannot answer (unreachable or not migrated), or None."""
        if self.store is None:
            return "no store"
        try:
            self.revision, has_tables = self.store.schema_state()
            if not has_tables:
                self.schema_problem = "the store has no celery_lease tables"
                return "not migrated"
            try:
                self.store.ensure_schema()
            except SchemaMismatch as exc:
                self.schema_problem = str(exc)
                return "not migrated"
            self.facts = self.store.reports.check_facts()
        except (StoreUnavailable, StoreRejected) as exc:
            return str(exc)
        return None

    @functools.cached_property
    def durations(self) -> dict[str, list[float]]:
        if self.store_error:
            return {}
        try:
            return {t.name: [r[0] for r in self.store.reports.runtime_sample(t.name)] for t in self.tasks}
        except (StoreUnavailable, StoreRejected):
            return {}  # the store went away after answering: check_store already said what it could

    def p99(self, task: Any) -> float | None:
        return percentile(self.durations.get(task.name, []), 99)

    def expected_runtime(self, task: Any) -> tuple[float | None, dict[str, Any]]:
        """The longest a task is expected to run: its limits and its measured p99."""
        policy = self.policies.get(task.name)
        values = {"time_limit": self.time_limit(task),
                  "lease_max_runtime": policy.max_runtime if policy else None, "p99": self.p99(task)}
        known = [v for v in values.values() if v]
        return (max(known) if known else None), values

    def task_facts(self, task: Any) -> dict[str, Any]:
        if self.store_error:
            return {}
        return self.facts["tasks"].get(task.name, {})


Rule = Callable[[Context], Iterator[Finding]]


def ok_unless(problems: list[Finding], code: str, settings: tuple[str, ...], ok_values: Mapping[str, Any],
              ok_why: str) -> Iterator[Finding]:
    """The problems found, or one ok finding that says what was checked."""
    if problems:
        yield from problems
    else:
        yield Finding(OK, code, settings, ok_values, ok_why)
