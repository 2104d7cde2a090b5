"""How the ``lease_*`` settings (the table in settings.py) are resolved for an app and a task, and validated.

Resolution order: task option > queue policy (``lease_queue_policies``) > app setting > default.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from .app_state import app_state
from .errors import LeaseConfigError, LeaseConfigErrors
from .masking import MASK

# The settings table, re-exported here by name: callers read it as ``config.SETTINGS`` etc.
from .settings import (
    BY_NAME,
    CALL_TIMEOUT_SHARE,
    DEFAULT_POOL_SIZE,
    LONG_CALL_TIMEOUT,
    METRICS_MAX_SERIES,
    PER_TASK,
    REAPER_OVERDUE_INTERVALS,
    REAPER_RUNS_KEPT,
    RUNBOOK_BASE_URL,
    SCRAPE_FRESH,
    SECRETS,
    SETTINGS,
)
from .vocabulary import Decision, OnLost

__all__ = ["SETTINGS", "AppConfig", "TaskPolicy", "app_config", "task_policy", "shortest_lease",
           "derive_stale_after", "worker_stale_after", "check_recovery_bound",
           "CALL_TIMEOUT_SHARE", "DEFAULT_POOL_SIZE", "LONG_CALL_TIMEOUT", "REAPER_RUNS_KEPT",
           "REAPER_OVERDUE_INTERVALS", "METRICS_MAX_SERIES", "SCRAPE_FRESH", "RUNBOOK_BASE_URL", "SECRETS",
           "BY_NAME", "PER_TASK"]


# Heartbeats a lease's duration holds at least, so two can fail before it expires.
HEARTBEATS_PER_LEASE = 3
# Seconds a process's exit waits at most for an unreachable store to take its deferred settle writes: within
# the 30 s a container is given to stop (Kubernetes' default) before it is killed.
EXIT_SETTLE_WAIT = 25.0
UNKNOWN = "unknown celery_lease setting"  # the rule of a misspelled or made-up setting


def written_as(name: str, namespace: str | None) -> str:
    """A setting's name as a user of this namespace writes it (Django: ``CELERY_LEASE_DURATION``)."""
    return f"{namespace}_{name}".upper() if namespace else name


def closest(written: str, namespace: str | None = None) -> str | None:
    """The valid setting closest to a misspelled one, written the same way; None when none is close."""
    name = written[len(namespace) + 1:].lower() if namespace else written
    # Compared without the "lease_" every name shares, which would make any two look alike.
    bare = {setting[len("lease_"):]: setting for setting in BY_NAME}
    match = difflib.get_close_matches(name.removeprefix("lease_"), bare, n=1, cutoff=0.75)
    return written_as(bare[match[0]], namespace) if match else None


def fix_for(problem: LeaseConfigError) -> str:
    """One line that says what to change for a config problem (``lease check``, Django's checks)."""
    if problem.rule == UNKNOWN:
        suggestion = closest(problem.setting, _namespace_of(problem.setting))
        if suggestion:
            return f"rename {problem.setting} to {suggestion}"
        return f"remove {problem.setting}: no celery_lease setting has that name"
    if problem.setting == "lease_heartbeat_interval":
        return "lower lease_heartbeat_interval to at most a third of lease_duration, or lengthen the lease"
    return f"set {problem.setting} to {problem.rule.removeprefix('must be ')}"


def _namespace_of(written: str) -> str | None:
    head, sep, _ = written.partition("_LEASE_")
    return head if sep and written.isupper() else None


def problems_of(error: LeaseConfigError) -> tuple[LeaseConfigError, ...]:
    """Each problem an error reports: its ``problems`` when it lists several, else itself."""
    return error.problems if isinstance(error, LeaseConfigErrors) else (error,)


def raise_all(problems: Sequence[LeaseConfigError]) -> None:
    """Raise every problem at once: the one error, or a LeaseConfigErrors listing them all."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise LeaseConfigErrors(problems)


def _unknown(written: str, value: Any, namespace: str | None = None) -> LeaseConfigError:
    suggestion = closest(written, namespace)
    if suggestion:
        return LeaseConfigError(written, value, UNKNOWN, f"Did you mean {suggestion}?")
    valid = ", ".join(written_as(name, namespace) for name in sorted(BY_NAME))
    return LeaseConfigError(written, value, UNKNOWN, f"Valid settings: {valid}")


def _validate(name: str, value: Any, source: str = "") -> Any:
    setting = BY_NAME.get(name)
    if setting is None:
        raise _unknown(name, value)
    try:
        return setting.check(value)
    except (ValueError, TypeError):
        shown = MASK if name in SECRETS and value is not None else value
        raise LeaseConfigError(name, shown, f"must be {setting.rule}", source) from None


def _cross_problems(values: Mapping[str, Any], where: str = "") -> list[LeaseConfigError]:
    """Every rule between two settings that ``values`` breaks."""
    problems = []
    duration, interval = values["lease_duration"], values["lease_heartbeat_interval"]
    if interval > duration / HEARTBEATS_PER_LEASE:
        problems.append(LeaseConfigError(
            "lease_heartbeat_interval", interval,
            f"must be at most a third of lease_duration ({duration:g}s){where}",
            "Lower the interval or lengthen the lease so two heartbeats can fail before it expires.",
        ))
    if "lease_idempotency_retention" in values and (
            values["lease_idempotency_retention"] < values["lease_retention"]):
        problems.append(LeaseConfigError(
            "lease_idempotency_retention", values["lease_idempotency_retention"],
            f"must be at least lease_retention ({values['lease_retention']:g}s){where}",
            "A key must outlive its job, or a pruned job's key would publish the job again.",
        ))
    if values["lease_store_retry_max"] < values["lease_store_retry_delay"]:
        problems.append(LeaseConfigError(
            "lease_store_retry_max", values["lease_store_retry_max"],
            f"must be >= lease_store_retry_delay ({values['lease_store_retry_delay']:g}){where}",
        ))
    lock_ttl = values.get("lease_lock_ttl")
    if lock_ttl is not None and lock_ttl < 2 * interval:
        problems.append(LeaseConfigError(
            "lease_lock_ttl", lock_ttl,
            f"must be at least two heartbeat intervals ({2 * interval:g}s){where}",
            "Renewed every interval, a shorter lock would pass its deadline before its next renewal lands.",
        ))
    if values["lease_backoff_max"] < values["lease_backoff_base"]:
        problems.append(LeaseConfigError(
            "lease_backoff_max", values["lease_backoff_max"],
            f"must be >= lease_backoff_base ({values['lease_backoff_base']:g}){where}",
        ))
    return problems


# The per-task options written on each job row, so any reaper applies the task's own policy.
RECOVERY = ("on_expired", "max_expirations", "backoff_base", "backoff_max", "backoff_jitter",
            "dead_letter_queue", "dispatch_timeout")


@dataclasses.dataclass(frozen=True)
class TaskPolicy:
    """The lease options in force for one task on one queue."""

    store_retry_delay: float
    store_retry_max: float
    duration: float
    heartbeat_interval: float
    grace_period: float
    max_runtime: float | None
    on_lost: OnLost
    max_attempts: int
    max_expirations: int
    on_expired: Decision
    backoff_base: float
    backoff_max: float
    backoff_jitter: bool
    dead_letter_queue: str | None
    dispatch_timeout: float
    lock_ttl: float | None
    lock_timeout: float

    def as_settings(self) -> dict[str, Any]:
        return {f"lease_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}

    def recovery(self) -> dict[str, Any]:
        """The options the reaper applies to an expired lease, as the job row carries them."""
        return {name: getattr(self, name) for name in RECOVERY}


@dataclasses.dataclass(frozen=True)
class AppConfig:
    """The validated app-wide settings, built once per app."""

    values: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[f"lease_{name}"]
        except KeyError:
            raise AttributeError(name) from None

    def policy(self, overrides: Mapping[str, Any] | None = None, queue: str | None = None,
               where: str = "") -> TaskPolicy:
        """Resolve task options > queue policy > app settings > defaults."""
        merged = {name: self.values[name] for name in PER_TASK}
        layers = []
        if queue and queue in self.values["lease_queue_policies"]:
            layers.append((self.values["lease_queue_policies"][queue], f"lease_queue_policies[{queue!r}]"))
        if overrides:
            layers.append((overrides, where))
        for layer, source in layers:
            for name, value in layer.items():
                if name not in BY_NAME or not BY_NAME[name].per_task:
                    raise LeaseConfigError(
                        name, value, f"is not a per-task lease option ({source})",
                        "Per-task options: " + ", ".join(PER_TASK),
                    )
                merged[name] = _validate(name, value, source)
        raise_all(_cross_problems(merged, f" ({where})" if where else ""))
        return TaskPolicy(**{name[len("lease_"):]: merged[name] for name in PER_TASK})


def shortest_lease(cfg: AppConfig, tasks: Any = ()) -> float:
    """The shortest lease_duration among the app setting, the queue policies and ``tasks``' options."""
    durations = [cfg.duration]
    durations += [float(p["lease_duration"]) for p in cfg.queue_policies.values() if "lease_duration" in p]
    for task in tasks:
        value = getattr(task, "lease_duration", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            durations.append(float(value))
    return min(durations)


def _written(conf: Any, name: str, namespace: str | None) -> str:
    """How the configuration spells a setting it sets (its lease name when it does not set it)."""
    spelled = written_as(name, namespace)
    return spelled if namespace and spelled in conf.keys() else name


def _sets(conf: Any, name: str, namespace: str | None) -> bool:
    """Whether the configuration sets ``name`` itself (not left to its default)."""
    return name in conf or bool(namespace and written_as(name, namespace) in conf)


def _read(conf: Any, name: str, namespace: str | None) -> Any:
    if name in conf:
        return conf[name]
    if namespace and written_as(name, namespace) in conf:
        return conf[written_as(name, namespace)]
    return BY_NAME[name].default


def load(conf: Mapping[str, Any], namespace: str | None = None) -> AppConfig:
    """Validate a Celery configuration's ``lease_*`` settings into an AppConfig, reporting every problem at
    once, each named as the configuration spells it."""
    prefix = f"{namespace}_lease_".upper() if namespace else None
    problems: dict[str, LeaseConfigError] = {}
    for key in list(conf.keys()):
        if not isinstance(key, str):
            continue
        if key.startswith("lease_") or (prefix and key.startswith(prefix)):
            name = key if key.startswith("lease_") else key[len(namespace or "") + 1:].lower()
            if name not in BY_NAME:
                problems[key] = _unknown(key, conf[key], namespace if key != name else None)
    values = {}
    for setting in SETTINGS:
        written = _written(conf, setting.name, namespace)
        try:
            values[setting.name] = _validate(setting.name, _read(conf, setting.name, namespace),
                                             f"Set as {written}" if written != setting.name else "")
        except LeaseConfigError as problem:
            problems[setting.name] = problem
    if not problems:
        problems.update((p.setting, p) for p in _cross_problems(values))
    if values.get("lease_database") is not None and _sets(conf, "lease_store_url", namespace):
        problems["lease_database"] = LeaseConfigError(
            "lease_database", values["lease_database"],
            f"is set together with {written_as('lease_store_url', namespace)}: the store would follow "
            "both a Django database and a URL",
            f"Remove {written_as('lease_store_url', namespace)} (the store follows the database alias) "
            f"or {written_as('lease_database', namespace)}.")
    raise_all(list(problems.values()))
    for queue, options in values["lease_queue_policies"].items():
        if not isinstance(options, Mapping):
            raise LeaseConfigError(
                "lease_queue_policies", {queue: options}, "each queue maps to a dict of lease options"
            )
    config = AppConfig(values)
    for queue in values["lease_queue_policies"]:
        config.policy(queue=queue, where=f"lease_queue_policies[{queue!r}]")
    return config


def app_config(app: Any) -> AppConfig:
    """The app's validated settings, cached on the app."""
    state = app_state(app)
    cached: AppConfig | None = state.config
    if cached is None:
        cached = state.config = load(app.conf, getattr(app, "namespace", None))
    return cached


def _misspelled_option(task: Any) -> str | None:
    """A ``lease_*`` attribute the task's own classes set that is no setting (a typo would be ignored)."""
    mro = type(task).__mro__
    ours = {name for cls in mro if cls.__module__.split(".")[0] == "celery_lease" for name in vars(cls)}
    for cls in mro:
        for name, value in vars(cls).items():
            # A method or property of the app's own (``lease_summary``) is not an option.
            if (name.startswith("lease_") and name not in BY_NAME and name not in ours
                    and not callable(value) and not hasattr(value, "__get__")):
                return name
    return None


def task_options(task: Any) -> dict[str, Any]:
    """The ``lease_*`` options a task sets as class attributes or decorator keywords."""
    written = _misspelled_option(task)
    if written is not None:
        suggestion = closest(written)
        raise LeaseConfigError(written, getattr(task, written), f"is not a lease option (task {task.name})",
                               f"Did you mean {suggestion}?" if suggestion
                               else f"Task options: {', '.join(PER_TASK)}")
    for setting in SETTINGS:
        if not setting.per_task and getattr(task, setting.name, None) is not None:
            raise LeaseConfigError(
                setting.name, getattr(task, setting.name), f"is an app-wide setting, not a task option "
                f"(task {task.name})", f"Set app.conf.{setting.name} instead.",
            )
    return {name: getattr(task, name) for name in PER_TASK if getattr(task, name, None) is not None}


def task_policy(task: Any, queue: str | None = None) -> TaskPolicy:
    """Resolve a task's lease policy for a queue (cached per task and queue)."""
    cache = task.__dict__.setdefault("_lease_policies", {})
    policy = cache.get(queue)
    if policy is None:
        options = task_options(task)
        time_limit = getattr(task, "time_limit", None) or task.app.conf.task_time_limit
        if "lease_max_runtime" not in options and time_limit:
            options["lease_max_runtime"] = time_limit
        policy = app_config(task.app).policy(options, queue, where=f"task {task.name}")
        cache[queue] = policy
    return policy


STALE_HEARTBEATS = 3  # a live worker may miss this many heartbeats before it looks gone


def derive_stale_after(policies: list[TaskPolicy]) -> float:
    """The registry silence after which a worker is gone: a dead owner is stale by the time its lease is
    past grace, a live one (three heartbeats) never is."""
    interval = max(p.heartbeat_interval for p in policies)
    window = min(p.duration + p.grace_period for p in policies)
    return max(STALE_HEARTBEATS * interval, window - interval)


def cfg_stale_after(cfg: AppConfig) -> float:
    """``lease_worker_stale_after`` as set, or derived from the app-wide and queue policies alone."""
    explicit = cfg.values["lease_worker_stale_after"]
    if explicit is not None:
        return explicit
    return derive_stale_after([cfg.policy()] + [cfg.policy(queue=queue) for queue in cfg.queue_policies])


def _lease_policies(app: Any) -> list[TaskPolicy]:
    """The app's policy, each queue policy's, and each registered LeaseTask's."""
    cfg = app_config(app)
    policies = [cfg.policy()] + [cfg.policy(queue=queue) for queue in cfg.queue_policies]
    for task in list(app.tasks.values()):
        if hasattr(task, "lease_policy"):
            try:
                policies.append(task_policy(task))
            except LeaseConfigError:
                continue  # refused where the task is used (and reported by `lease check`)
    return policies


def worker_stale_after(app: Any) -> float:
    """``lease_worker_stale_after`` as set, or derived from every lease policy of the app."""
    explicit = app_config(app).values["lease_worker_stale_after"]
    if explicit is not None:
        return explicit
    tasks = len(app.tasks)
    state = app_state(app)
    cached = state.stale_after
    if cached is None or cached[0] != tasks:
        cached = state.stale_after = (tasks, derive_stale_after(_lease_policies(app)))
    return cached[1]


def check_recovery_bound(app: Any) -> None:
    """Refuse a ``lease_worker_stale_after`` that delays a dead worker's jobs past lease + grace."""
    explicit = app_config(app).values["lease_worker_stale_after"]
    if explicit is None:
        return
    policies = _lease_policies(app)
    window = min(p.duration + p.grace_period for p in policies)
    if explicit > window:
        raise LeaseConfigError(
            "lease_worker_stale_after", explicit,
            f"must be at most the shortest lease_duration + lease_grace_period ({window:g}s): a dead "
            f"worker's jobs would wait {explicit:g}s for the reaper instead of {window:g}s",
            f"Leave it unset (derived: {derive_stale_after(policies):g}s) or lower it.",
        )
