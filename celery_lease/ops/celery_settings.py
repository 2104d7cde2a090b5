"""``lease check`` on Celery 5.5–5.7's settings that overlap the lease's job, and on the Celery floor.

A setting the installed Celery does not know but the app sets is a warning: that Celery ignores it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import celery
from celery.app.defaults import DEFAULTS

from ..integration.signals import acks_on_timeout
from .check_context import OK, WARNING, Context, Finding

__all__ = ["FEATURES", "missing_features", "celery_rules", "BEAT_PING_TIMEOUT"]

log = logging.getLogger(__name__)

BEAT_PING_TIMEOUT = 1.0  # seconds `lease check` waits for celery beat to answer ping

#: (setting, what it is, the first Celery version that has it).
FEATURES: tuple[tuple[str, str, str], ...] = (
    ("worker_soft_shutdown_timeout", "soft shutdown", "5.5"),
    ("worker_enable_soft_shutdown_on_idle", "soft shutdown on an idle worker", "5.5"),
    ("task_retry_on_worker_lost", "retry a lost worker's task", "5.7"),
    ("task_acks_on_failure", "acknowledge on failure (split of task_acks_on_failure_or_timeout)", "5.7"),
    ("task_acks_on_timeout", "acknowledge on a hard time limit (split of task_acks_on_failure_or_timeout)",
     "5.7"),
    ("worker_pool_start_method", "prefork children started by spawn", "5.7"),
    ("beat_enable_remote_control", "beat answers ping", "5.7"),
)


def missing_features(defaults: Any = DEFAULTS) -> dict[str, str]:
    """The settings of FEATURES that the installed Celery does not know, each with its first version."""
    return {setting: first for setting, _, first in FEATURES if setting not in defaults}


def celery_rules(ctx: Context) -> Iterator[Finding]:
    """The floor, then what each 5.5–5.7 setting does to a leased job."""
    yield from _floor(ctx)
    yield from _retry_on_worker_lost(ctx)
    yield from _acks_on_timeout(ctx)
    yield from _beat_alive(ctx)


def _set_by_app(conf: Any, setting: str) -> bool:
    """Whether the app's own configuration gives ``setting`` (defaults left out), under its namespace
    (``CELERY_...``) or an old name too: Celery 5.7's ``value_set_for``; before 5.7 it misses a namespace."""
    conf.finalize()
    own = type(conf)({}, conf.maps[:-1], conf.__dict__.get("_keys"), conf.__dict__.get("prefix"))
    return setting in own


def _floor(ctx: Context) -> Iterator[Finding]:
    missing = missing_features()
    settings = tuple(setting for setting, _, _ in FEATURES)
    values = {"celery": celery.__version__, "missing": missing}
    # Set at all, whatever the value: an app that writes task_acks_on_timeout = False expects it to act.
    ignored = {s: first for s, first in missing.items() if _set_by_app(ctx.conf, s)}
    if ignored:
        yield Finding(WARNING, "celery_features", settings, {**values, "ignored": ignored},
                      f"Celery {celery.__version__} does not know "
                      + ", ".join(f"{s} (Celery {v})" for s, v in ignored.items())
                      + ": the app sets it and nothing happens",
                      "upgrade Celery to the version named, or remove the setting")
    elif missing:
        yield Finding(OK, "celery_features", settings, values,
                      f"Celery {celery.__version__} lacks "
                      + ", ".join(f"{s} (Celery {v})" for s, v in missing.items())
                      + "; the app sets none of them")
    else:
        yield Finding(OK, "celery_features", settings, values,
                      f"Celery {celery.__version__} has every setting celery_lease checks")


def _task_flag(ctx: Context, task: Any, attribute: str) -> bool | None:
    value = getattr(task, attribute, None)
    if value is None:
        value = ctx.conf.get(f"task_{attribute}")
    return value if value is None else bool(value)


def _retry_on_worker_lost(ctx: Context) -> Iterator[Finding]:
    if "task_retry_on_worker_lost" not in DEFAULTS:
        return
    tasks = sorted(t.name for t in ctx.tasks if _task_flag(ctx, t, "retry_on_worker_lost"))
    if not tasks:
        return
    yield Finding(OK, "retry_on_worker_lost", ("task_retry_on_worker_lost", "lease_max_attempts"),
                  {"tasks": tasks, "task_retry_on_worker_lost": ctx.conf.task_retry_on_worker_lost},
                  "for these LeaseTasks the lease re-runs a lost child's job itself, once, counted in "
                  "self.lease.attempt up to lease_max_attempts; Celery's own retry is not sent, so "
                  "max_retries does not bound it and request.retries stays as it was")


def _acks_on_timeout(ctx: Context) -> Iterator[Finding]:
    again = sorted(t.name for t in ctx.tasks if ctx.acks_late(t) and not acks_on_timeout(t))
    if again:
        yield Finding(OK, "acks_on_timeout", ("task_acks_on_timeout", "task_acks_late", "lease_max_attempts"),
                      {"tasks": again},
                      "a hard time limit requeues these jobs (Celery requeues the message, the lease the "
                      "job): each timeout counts an attempt, and at lease_max_attempts the job is "
                      "dead-lettered instead of looping")


def _beat_alive(ctx: Context) -> Iterator[Finding]:
    """Whether celery beat answers ping: it stops answering once its scheduler stops ticking."""
    if "beat_enable_remote_control" not in DEFAULTS or not ctx.conf.beat_enable_remote_control:
        return
    settings = ("beat_enable_remote_control",)
    try:
        replies = ctx.app.control.ping(timeout=BEAT_PING_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - a check reports an unreachable broker, it does not fail
        log.debug("ping for celery beat failed: %s", exc)
        yield Finding(WARNING, "beat_alive", settings, {"error": str(exc)},
                      f"celery beat could not be pinged: {exc}",
                      "check the broker URL; `celery -A proj inspect ping` shows who answers")
        return
    beats = sorted(node for reply in replies for node in reply if node.startswith("celerybeat@"))
    if beats:
        yield Finding(OK, "beat_alive", settings, {"beat": beats},
                      f"celery beat answers ping ({', '.join(beats)}): the process that schedules the "
                      "reaper is alive")
    else:
        yield Finding(WARNING, "beat_alive", settings, {"beat": [], "timeout": BEAT_PING_TIMEOUT},
                      f"no celery beat answered ping within {BEAT_PING_TIMEOUT:g}s: beat is not running, "
                      "or its scheduler stopped ticking, so nothing schedules the reaper (reaper_running "
                      "says when it last ran)",
                      "start celery beat (with beat_enable_remote_control = True it answers ping)")
