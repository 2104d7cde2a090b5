"""The settings table: every ``lease_*`` option's default (defined only here), its rule and its purpose."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from .vocabulary import Decision, OnLost

__all__ = ["Setting", "SETTINGS", "BY_NAME", "SECRETS", "PER_TASK", "IDENTIFIER",
           "CALL_TIMEOUT_SHARE", "DEFAULT_POOL_SIZE", "LONG_CALL_TIMEOUT", "REAPER_RUNS_KEPT",
           "REAPER_OVERDUE_INTERVALS", "METRICS_MAX_SERIES", "SCRAPE_FRESH", "RUNBOOK_BASE_URL"]

# A store call may take at most this share of the shortest lease: a hung renewal bounded by the
# heartbeat's third of a lease fails in time for the next one to run.
CALL_TIMEOUT_SHARE = 1 / 3
DEFAULT_POOL_SIZE = 10  # pooled store connections of a process when the worker's concurrency is unknown
LONG_CALL_TIMEOUT = 300.0  # seconds for the reaper's batches, migrations and reads: no lease waits on them
REAPER_RUNS_KEPT = 1000  # reaper runs kept in the store; each run prunes the older ones
REAPER_OVERDUE_INTERVALS = 3  # a reaper whose last run is this many intervals old is not running
METRICS_MAX_SERIES = 200  # label pairs (queue, task) per exporter metric; the rest count as "other"
SCRAPE_FRESH = 600.0  # seconds after which the exporter's last scrape is old (scrapes come every 15-60 s)
# Where the shipped alert rules' runbook_url annotations point by default: the operator's playbook.
RUNBOOK_BASE_URL = "https://github.com/celery-lease/celery-lease/blob/main/docs/operators.md"

# 30 characters keep the longest index name within PostgreSQL's 63-character identifier limit.
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
        # NaN passes every comparison below (a NaN grace never lets the reaper take a lease back).
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
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
    # The choice itself is the value: a vocabulary member where the choices are members.
    def check(value: Any) -> str:
        for choice in choices:
            if value == choice:
                return choice
        raise ValueError

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


def _optional_text(value: Any) -> str | None:
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
       _optional_text, "None or a non-empty database alias", False),
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
       "lost at its local deadline, as lease_on_lost says (default: the run's time_limit, a call's own "
       "included).",
       _number(0, strict=True, allow_none=True), "None or a number of seconds > 0", True),
    _S("lease_on_lost", "raise",
       "What a task body sees when its lease is lost: 'raise' LeaseLost in it, or 'flag' only.",
       _choice(*OnLost), "one of 'raise', 'flag'", True),
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
       _choice(Decision.REQUEUE, Decision.DEAD_LETTER, Decision.FAIL),
       "one of 'requeue', 'dead_letter', 'fail'", True),
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
       _optional_text, "None or a queue name", True),
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
       "apply_async calls per second, as measured (docs/costs.md). False waits for the flush.",
       _bool, "True or False", False),
    _S("lease_audit_every_transition", False,
       "Write an event row for every claim and completion too. False records only decisions (a "
       "re-claim, a takeover, a recovery, a stale write...): a first claim and its owner's completion "
       "are read from the job's row (started_at, completed_at, attempt_count, locked_by). True costs two "
       "more rows per job.",
       _bool, "True or False", False),
    _S("lease_group_commit", False,
       "First claims and completions due at the same moment in one worker process (threads, gevent) "
       "share one commit: the first writes every one of its kind queued meanwhile, each row fenced by "
       "its own token (a claim the batch cannot take is decided alone); so do the records of publishes "
       "made from many threads at once (a web server's), those with an idempotency key excepted. A "
       "lone write waits for nobody and is written as with False. PostgreSQL and SQLite; "
       "MySQL/MariaDB write each alone whatever the setting.",
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
       "Keep the Redis messages a live worker holds (leased acks_late jobs, prefetched messages, and ETA "
       "messages on Celery 5.7 and later) from being restored by kombu's visibility timeout.",
       _bool, "True or False", False),
    _S("lease_rabbitmq_consumer_timeout", None,
       "Seconds RabbitMQ lets a delivery go unacknowledged (its consumer_timeout), for `lease check`; "
       "None: ask the management API, else assume RabbitMQ's default of 1800.",
       _number(0, strict=True, allow_none=True), "None or a number of seconds > 0", False),
    # operations
    _S("lease_runbook_base_url", RUNBOOK_BASE_URL,
       "Absolute URL of the operator's playbook that alert rules link to (runbook_url = this URL + "
       "'#' + the step's anchor); point it at your own copy of docs/operators.md.",
       _url, "an absolute http(s) URL without a '#' fragment", False),
    # the web page (`celery lease web`)
    _S("lease_web_token", None,
       "Bearer token `celery lease web` asks of every request (an 'Authorization: Bearer ...' header, "
       "or typed once on its sign-in page). None: no token.",
       _optional_text, "None or a non-empty string", False),
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
