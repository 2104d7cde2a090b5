"""Every ``lease_*`` setting: its default, its rule, and how it is resolved.

Each option has one name, ``lease_<name>``, used both as the Celery setting and as
the per-task option. Resolution order: task option > queue policy
(``lease_queue_policies``) > app setting > default. Values are validated once and
frozen; a bad value raises :class:`LeaseConfigError` naming the key, the value and
the rule. Defaults live here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import LeaseConfigError, LeaseConfigErrors
from .masking import MASK

__all__ = ["SETTINGS", "Setting", "AppConfig", "TaskPolicy", "app_config", "task_policy", "shortest_lease",
           "derive_stale_after", "worker_stale_after", "check_recovery_bound",
           "CALL_TIMEOUT_SHARE", "DEFAULT_POOL_SIZE", "LONG_CALL_TIMEOUT", "REAPER_RUNS_KEPT",
           "REAPER_OVERDUE_INTERVALS", "METRICS_MAX_SERIES", "SCRAPE_FRESH", "RUNBOOK_BASE_URL", "SECRETS"]

# A store call may take at most this share of the shortest lease (seconds per second). The
# heartbeat runs at most every third of a lease so that two renewals can fail before it
# expires; a hung renewal bounded by the same third fails in time for the next one to run.
CALL_TIMEOUT_SHARE = 1 / 3
# Pooled store connections of a process when the worker's concurrency is unknown.
DEFAULT_POOL_SIZE = 10
# Seconds the reaper's batches, migrations and operators' reads may take: they hold a batch
# of rows while publishing, or scan history, and no lease waits on them.
LONG_CALL_TIMEOUT = 300.0
# Reaper runs kept in the store (newest first); each run prunes the older ones.
REAPER_RUNS_KEPT = 1000
# A scheduled reaper whose last run is older than this many intervals is reported as not running.
REAPER_OVERDUE_INTERVALS = 3
# Label pairs (queue, task) per exporter metric; the rest are counted under "other".
METRICS_MAX_SERIES = 200
# Seconds after which the exporter's last scrape counts as old (scrapes come every 15-60 s).
SCRAPE_FRESH = 600.0
# Where the shipped alert rules' runbook_url annotations point by default: the README's playbook.
RUNBOOK_BASE_URL = "https://github.com/celery-lease/celery-lease/blob/main/README.md"

# 30 characters keep the longest index name ("<prefix>jobs_status_available_ix") within
# PostgreSQL's 63-character identifier limit.
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,29}$")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``lease_*`` option: its default, its rule and what it is for."""

    name: str
    default: Any
    doc: str
    check: Callable[[Any], Any]
    rule: str
    per_task: bool


def _number(minimum: float, *, strict: bool = False, allow_none: bool = False) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        if value < minimum or (strict and value == minimum):
            raise ValueError
        return float(value)

    return check


def _integer(minimum: int) -> Callable[[Any], Any]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError
        return value

    return check


def _choice(*choices: str) -> Callable[[Any], Any]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError
        return value

    return check


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError
    return value


def _url(value: Any) -> str:
    if not isinstance(value, str) or not re.match(r"^https?://[^\s#]+$", value):
        raise ValueError
    return value


def _optional_queue(value: Any) -> str | None:
    if value is None:
        return None
    return _text(value)


def _optional_secret(value: Any) -> str | None:
    if value is None:
        return None
    return _text(value)


def _basic_auth(value: Any) -> str | None:
    if value is None:
        return None
    user, sep, password = _text(value).partition(":")
    if not (sep and user and password):
        raise ValueError
    return value


def _optional_import_path(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$", value):
        raise ValueError
    return value


def _identifier(value: Any) -> str:
    if not isinstance(value, str) or not (value == "" or IDENTIFIER.match(value)):
        raise ValueError
    return value


def _mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError
    return dict(value)


_S = Setting
SETTINGS: tuple[Setting, ...] = (
    # store
    _S("lease_store_url", "sqlite:///celery_lease.sqlite3",
       "SQLAlchemy URL of the lease store (SQLite file, PostgreSQL or MySQL/MariaDB).",
       _text, "a non-empty SQLAlchemy URL", False),
    _S("lease_database", None,
       "A Django database alias (celery_lease.contrib.django): the store's URL is taken from "
       "connections[alias].settings_dict at first use, so under Django's test runner it is the test "
       "database. The store keeps connections of its own. Set this or lease_store_url, not both.",
       _optional_queue, "None or a non-empty database alias", False),
    _S("lease_table_prefix", "celery_lease_",
       "Prefix of the store's table names.",
       _identifier, "letters, digits and underscores, not starting with a digit, at most 30", False),
    _S("lease_sqlite_busy_timeout", 30.0,
       "Seconds a SQLite writer waits for the file lock before failing; at most half the store call "
       "bound (a third of the shortest lease), so that a call stays bounded (a reaper batch or an "
       "operator's command: half the long bound). Reads do not wait for it.",
       _number(0), "a number of seconds >= 0", False),
    _S("lease_sqlite_synchronous", "FULL",
       "SQLite's synchronous pragma: 'FULL' syncs the WAL on every commit, so a commit carrying a "
       "completion or an effect survives an OS crash or power loss; 'NORMAL' syncs at checkpoints "
       "only (faster commits, but the last ones may be lost with the OS, and a lost completion runs "
       "its job again).",
       _choice("FULL", "NORMAL"), "one of 'FULL', 'NORMAL'", False),
    _S("lease_store_engine_options", {},
       "Keyword arguments merged last into SQLAlchemy's create_engine, e.g. "
       "{'poolclass': sqlalchemy.pool.NullPool} behind PgBouncer.",
       _mapping, "a mapping of create_engine keyword arguments", False),
    _S("lease_store_retry_delay", 5.0,
       "Seconds before a delivery that found the store unreachable is delivered again (fail closed); "
       "each time the same message finds it unreachable again the delay doubles, up to "
       "lease_store_retry_max, with jitter. Meanwhile the worker stops consuming until the store "
       "answers, asking it every lease_store_retry_delay (the app's).",
       _number(0, strict=True), "a number of seconds > 0", True),
    _S("lease_store_retry_max", 300.0,
       "Upper bound in seconds of the fail-closed re-send delay.",
       _number(0, strict=True), "a number of seconds > 0, at least lease_store_retry_delay", True),
    # lease
    _S("lease_duration", 30.0,
       "Seconds a lease lasts without a heartbeat.",
       _number(0, strict=True), "a number of seconds > 0", True),
    _S("lease_heartbeat_interval", 10.0,
       "Seconds between heartbeats; at most a third of lease_duration.",
       _number(0, strict=True), "a number of seconds > 0", True),
    _S("lease_grace_period", 10.0,
       "Seconds past expiry before a lease may be taken back.",
       _number(0), "a number of seconds >= 0", True),
    _S("lease_max_runtime", None,
       "Seconds after which a job's lease and its resource locks are no longer renewed: the lease is "
       "lost at its local deadline, as lease_on_lost says (default: the task's time_limit).",
       _number(0, strict=True, allow_none=True), "None or a number of seconds > 0", True),
    _S("lease_on_lost", "raise",
       "What a task body sees when its lease is lost: 'raise' LeaseLost in it, or 'flag' only.",
       _choice("raise", "flag"), "one of 'raise', 'flag'", True),
    # attempts and recovery
    _S("lease_max_attempts", 5,
       "Executions a job may start before an expired lease dead-letters it.",
       _integer(1), "an integer >= 1", True),
    _S("lease_max_expirations", 3,
       "Lease expirations a job may suffer before lease_on_expired stops requeueing it.",
       _integer(1), "an integer >= 1", True),
    _S("lease_on_expired", "requeue",
       "What the reaper does with an expired lease: 'requeue' while attempts last, "
       "'dead_letter' at once, or 'fail' at once without publishing.",
       _choice("requeue", "dead_letter", "fail"), "one of 'requeue', 'dead_letter', 'fail'", True),
    _S("lease_backoff_base", 1.0,
       "Seconds of the first requeue delay; doubles per attempt.",
       _number(0), "a number of seconds >= 0", True),
    _S("lease_backoff_max", 300.0,
       "Upper bound in seconds of the requeue delay.",
       _number(0), "a number of seconds >= 0", True),
    _S("lease_backoff_jitter", True,
       "Full jitter on the requeue delay (uniform between 0 and the exponential delay).",
       _bool, "True or False", True),
    _S("lease_dead_letter_queue", None,
       "Queue that receives the message of a dead-lettered job (None: keep it in the store only).",
       _optional_queue, "None or a queue name", True),
    _S("lease_claim_async_commit", False,
       "PostgreSQL, opt-in: commit a claim without waiting for its WAL flush. A server crash may then "
       "undo a claim made in its last moments: the job is pending again, another delivery (a duplicate, "
       "a redelivery, the dispatch scan) claims it, and the first run goes on beside the second until "
       "its first heartbeat after the restart finds the lease lost (at worst until its local deadline): "
       "two owners. A synchronous standby does not wait for such a claim either, so a failover can lose "
       "it the same way. False waits for the flush (about 5% fewer 10 ms tasks per second).",
       _bool, "True or False", False),
    _S("lease_publish_async_commit", False,
       "PostgreSQL: commit a publish's record (job, key, event) without waiting for its WAL flush. "
       "A server crash may then undo records of its last moments: a job whose message was lost as "
       "well is not sent again, and its idempotency key can be taken again. Up to a fifth more "
       "apply_async calls per second, as measured (README, What it costs). False waits for the flush.",
       _bool, "True or False", False),
    _S("lease_clock_tolerance", 1.0,
       "Seconds a delivery may arrive before its job's available_at (countdown, retry ETA, backoff) "
       "and still run, for worker clocks ahead of the store's; an earlier one is sent again for later.",
       _number(0), "a number of seconds >= 0", False),
    _S("lease_dispatch_timeout", 600.0,
       "Seconds a pending job may wait past available_at before its message is re-published; after "
       "each re-publish the job waits twice as long (up to lease_dispatch_backoff_max).",
       _number(0, strict=True), "a number of seconds > 0", True),
    _S("lease_dispatch_backoff_max", 10800.0,
       "Upper bound in seconds of the wait between two re-publishes of one pending job's message "
       "(lease_dispatch_timeout x 2^re-publishes so far, never less than lease_dispatch_timeout): a job "
       "queued behind a long backlog gets a few copies, not one per lease_dispatch_timeout, and a job "
       "whose copies keep vanishing is still re-sent at least this often.",
       _number(0, strict=True), "a number of seconds > 0", False),
    # reaper and registry
    _S("lease_reaper_batch_size", 100,
       "Jobs the reaper recovers at most per run and per kind of work.",
       _integer(1), "an integer >= 1", False),
    _S("lease_reaper_hard_grace", 120.0,
       "Seconds past expiry after which a lease is reaped even when its owner looks alive.",
       _number(0), "a number of seconds >= 0", False),
    _S("lease_reaper_lock_ttl", 60.0,
       "Seconds the reaper's own lock lasts; a reaper that dies mid-run holds up the next one this long.",
       _number(0, strict=True), "a number of seconds > 0", False),
    _S("lease_worker_stale_after", None,
       "Seconds without a heartbeat after which a worker process counts as gone. None: derived from "
       "the lease settings (the shortest lease_duration + lease_grace_period minus the longest "
       "heartbeat interval, at least three such intervals), so a dead worker's jobs are back within "
       "lease + grace + reaper interval; a larger value is refused at worker start.",
       _number(0, strict=True, allow_none=True), "None or a number of seconds > 0", False),
    _S("lease_retention", 7 * 24 * 3600.0,
       "Seconds finished jobs and events are kept before the reaper prunes them.",
       _number(0, strict=True), "a number of seconds > 0", False),
    _S("lease_idempotency_retention", 30 * 24 * 3600.0,
       "Seconds an idempotency key is kept, even after its job was pruned: within this window a repeated "
       "key returns the first job's result handle instead of publishing again. At least lease_retention.",
       _number(0, strict=True), "a number of seconds > 0, at least lease_retention", False),
    _S("lease_queue_policies", {},
       "Per-queue lease options, e.g. {'reports': {'lease_duration': 600}}.",
       _mapping, "a mapping of queue name to per-task lease options", False),
    # broker alignment
    _S("lease_extend_visibility", True,
       "Keep the Redis messages a live worker holds (leased acks_late jobs, prefetched and ETA "
       "messages) from being restored by kombu's visibility timeout.",
       _bool, "True or False", False),
    _S("lease_rabbitmq_consumer_timeout", None,
       "Seconds RabbitMQ lets a delivery go unacknowledged (its consumer_timeout), for `lease check`; "
       "None: ask the management API, else assume RabbitMQ's default of 1800.",
       _number(0, strict=True, allow_none=True), "None or a number of seconds > 0", False),
    # operations
    _S("lease_runbook_base_url", RUNBOOK_BASE_URL,
       "Absolute URL of the operator's playbook that alert rules link to (runbook_url = this URL + "
       "'#' + the step's anchor); point it at your own copy of the README.",
       _url, "an absolute http(s) URL without a '#' fragment", False),
    # the web page (`celery lease web`)
    _S("lease_web_token", None,
       "Bearer token `celery lease web` asks of every request (an 'Authorization: Bearer ...' header, "
       "or typed once on its sign-in page). None: no token.",
       _optional_secret, "None or a non-empty string", False),
    _S("lease_web_basic_auth", None,
       "'user:password' that `celery lease web` asks of every request by HTTP basic authentication. "
       "None: no password. With neither this nor lease_web_token, the page answers only requests "
       "addressed to an IP address or localhost.",
       _basic_auth, "None or a 'user:password' string with a non-empty user and password", False),
    _S("lease_web_show_arguments", False,
       "Show jobs' message arguments on `celery lease web`'s job page; they may hold personal data, so "
       "they are hidden by default.",
       _bool, "True or False", False),
    # eager runs
    _S("lease_eager_store", False,
       "Eager runs (task_always_eager, apply()) take a real lease in the store, so effects, locks and "
       "checkpoints are fenced there as in a worker. False: self.lease is a local handle whose effect "
       "keys are kept in this process (once per key within it) and whose locks are in-process locks.",
       _bool, "True or False", False),
    # tests
    _S("lease_fault_injector", None,
       "'module:attr' of an object that tests hand every store engine (``engine_built(engine, store)``) "
       "and every result-backend call of the library (``backend_call(verb, task_id)``) to inject "
       "faults; None in production, where nothing is installed and nothing is asked.",
       _optional_import_path, "None or a 'module:attr' import path", False),
    # resource locks
    _S("lease_lock_ttl", None,
       "Seconds a resource lock lasts without renewal (None: the lease's duration); at least two "
       "heartbeat intervals. Its holder stops trusting it, and the job its lease, at a local deadline "
       "before the store's expiry (the last confirmed renewal's send time + this - the safety margin), "
       "whether or not the store answers.",
       _number(0, strict=True, allow_none=True), "None or a number of seconds > 0", True),
    _S("lease_lock_timeout", 10.0,
       "Seconds lock() waits for a held resource before LockUnavailable.",
       _number(0), "a number of seconds >= 0", True),
)
BY_NAME = {s.name: s for s in SETTINGS}
# Settings whose values are credentials: an error about them never shows the value.
SECRETS = ("lease_web_token", "lease_web_basic_auth")
PER_TASK = tuple(s.name for s in SETTINGS if s.per_task)


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


def _cross_check(values: Mapping[str, Any], where: str = "") -> None:
    raise_all(_cross_problems(values, where))


def _cross_problems(values: Mapping[str, Any], where: str = "") -> list[LeaseConfigError]:
    """Every rule between two settings that ``values`` breaks."""
    problems = []
    duration, interval = values["lease_duration"], values["lease_heartbeat_interval"]
    if interval > duration / 3:
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
    on_lost: str
    max_attempts: int
    max_expirations: int
    on_expired: str
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
        _cross_check(merged, f" ({where})" if where else "")
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
    if namespace:
        key = f"{namespace}_{name}".upper()
        if key in conf:
            return conf[key]
    return BY_NAME[name].default


def load(conf: Mapping[str, Any], namespace: str | None = None) -> AppConfig:
    """Validate a Celery configuration's ``lease_*`` settings into an AppConfig.

    Every problem is reported at once (LeaseConfigErrors when there are several), each
    naming the setting as the configuration spells it (``CELERY_LEASE_DURATON`` under
    Django's namespace) and a misspelled one the closest valid name.
    """
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
    cached = getattr(app, "_celery_lease_config", None)
    if cached is None:
        cached = load(app.conf, getattr(app, "namespace", None))
        app._celery_lease_config = cached
    return cached


def task_options(task: Any) -> dict[str, Any]:
    """The ``lease_*`` options a task sets as class attributes or decorator keywords."""
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


# -- worker liveness --------------------------------------------------------------
STALE_HEARTBEATS = 3  # a live worker may miss this many heartbeats before it looks gone


def derive_stale_after(policies: list[TaskPolicy]) -> float:
    """The registry silence after which a worker is gone, from the lease policies in force.

    At most the shortest lease + grace minus one (longest) heartbeat, so the reaper finds
    a dead owner stale by the time its lease is past grace; at least three of the longest
    heartbeat intervals, so a live worker never looks stale.
    """
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
    cached = getattr(app, "_celery_lease_stale_after", None)
    if cached is None or cached[0] != tasks:
        cached = (tasks, derive_stale_after(_lease_policies(app)))
        app._celery_lease_stale_after = cached
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
