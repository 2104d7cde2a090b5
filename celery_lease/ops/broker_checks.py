"""``lease check`` rules for the broker: its redelivery timeout against the jobs and the lease.

SQS queues are read as they are: an existing queue keeps its own ``VisibilityTimeout``.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

import celery

from ..config import worker_stale_after
from ..worker.brokers import REFRESH_SHARE
from .check_context import ERROR, OK, WARNING, Context, Finding, ok_unless
from .quorum_checks import quorum_rules

__all__ = ["broker_rules", "rabbitmq_consumer_timeouts", "RABBITMQ_DEFAULT_CONSUMER_TIMEOUT"]

log = logging.getLogger(__name__)

REDIS_DEFAULT_VISIBILITY = 3600.0  # seconds: kombu's Redis Channel.visibility_timeout
SQS_DEFAULT_VISIBILITY = 1800.0  # seconds: kombu's SQS Channel.default_visibility_timeout
SQS_MAX_VISIBILITY = 43200.0  # seconds: SQS hides a message at most 12 hours from its receipt
SQS_TIMEOUT = 2.0  # seconds per SQS request of `lease check` (one attempt, no retries)
RABBITMQ_DEFAULT_CONSUMER_TIMEOUT = 1800.0  # seconds: RabbitMQ's documented default (30 minutes)
MANAGEMENT_PORT = 15672
MANAGEMENT_TIMEOUT = 2.0  # seconds per HTTP request
DEMO_TRANSPORTS = ("memory", "filesystem", "sql")
VT = "broker_transport_options['visibility_timeout']"


def rabbitmq_consumer_timeouts(app: Any, queues: Iterable[str], configured: float | None,
                               port: int = MANAGEMENT_PORT) -> dict[str, tuple[float, str]]:
    """Each queue's consumer timeout and its source: management API, else ``configured``, else default."""
    connection = app.connection_for_read()
    host, vhost = connection.hostname or "localhost", connection.virtual_host or "/"
    credentials = f"{connection.userid or 'guest'}:{connection.password or 'guest'}"
    auth = base64.b64encode(credentials.encode()).decode()
    connection.release()
    fallback = ((configured, "lease_rabbitmq_consumer_timeout") if configured
                else (RABBITMQ_DEFAULT_CONSUMER_TIMEOUT, "RabbitMQ default"))
    timeouts = {}
    reachable = True
    for queue in sorted(set(queues)):
        timeouts[queue] = fallback
        if not reachable:
            continue
        url = (f"http://{host}:{port}/api/queues/{urllib.parse.quote(vhost, safe='')}/"
               f"{urllib.parse.quote(queue, safe='')}")
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {auth}"})
        try:
            with urllib.request.urlopen(request, timeout=MANAGEMENT_TIMEOUT) as reply:  # noqa: S310 - http only
                info = json.loads(reply.read())
        except (OSError, ValueError) as exc:
            # No management plugin, wrong credentials or no such queue yet: use the fallback.
            log.debug("RabbitMQ management API at %s not usable: %s", url, exc)
            reachable = isinstance(exc, (urllib.error.HTTPError, ValueError))
            continue
        milliseconds = ((info.get("arguments") or {}).get("x-consumer-timeout")
                        or (info.get("effective_policy_definition") or {}).get("consumer-timeout"))
        if milliseconds:
            timeouts[queue] = (float(milliseconds) / 1000.0, "management API")
    return timeouts


def _longest(ctx: Context) -> tuple[str | None, float | None, dict[str, Any]]:
    """The LeaseTask expected to run longest: name, seconds and where the number comes from."""
    best: tuple[str | None, float | None, dict[str, Any]] = (None, None, {})
    for task in ctx.tasks:
        expected, values = ctx.expected_runtime(task)
        if expected is not None and (best[1] is None or expected > best[1]):
            best = (task.name, expected, values)
    return best


def _takeover_after(ctx: Context) -> float:
    """Seconds after its worker dies before another worker may take a job's lease (longest policy)."""
    cfg, stale = ctx.cfg, worker_stale_after(ctx.app)
    after = [min(max(p.duration + p.grace_period, stale), p.duration + cfg.reaper_hard_grace)
             for p in ctx.policies.values()]
    return max(after, default=0.0)


def broker_rules(ctx: Context) -> Iterator[Finding]:
    kind = ctx.transport
    if kind == "redis":
        yield from _redis(ctx)
    elif kind == "amqp":
        yield from _rabbitmq(ctx)
    elif kind == "sqs":
        yield from _sqs(ctx)
    else:
        yield from _other(ctx, kind)


def _redis(ctx: Context) -> Iterator[Finding]:
    options = ctx.conf.broker_transport_options or {}
    vt = float(options.get("visibility_timeout", REDIS_DEFAULT_VISIBILITY))
    extend = ctx.cfg.extend_visibility
    base = {"visibility_timeout": vt, "lease_extend_visibility": extend}
    settings = (VT, "lease_extend_visibility")
    name, longest, sources = _longest(ctx)
    if not extend and longest is not None and longest > vt and any(ctx.acks_late(t) for t in ctx.tasks):
        yield Finding(ERROR, "visibility_vs_runtime", settings, {**base, "task": name, **sources},
                      f"task {name} may run {longest:g}s but kombu re-delivers an unacknowledged message "
                      "after "
                      f"{vt:g}s: every long run is delivered again (skipped by the lease, but restored long "
                      "jobs loop at the head of the queue and starve others)",
                      "set lease_extend_visibility = True, or raise visibility_timeout above the longest run")
    else:
        yield Finding(OK, "visibility_vs_runtime", settings, {**base, "task": name, "longest": longest},
                      "live workers keep their running messages" if extend
                      else "every run ends inside the visibility timeout")
    delays = {t.name: ctx.task_facts(t).get("longest_delay", 0.0) for t in ctx.tasks}
    delay_task = max(delays, key=lambda n: delays[n], default=None)
    delay = delays.get(delay_task, 0.0) if delay_task else 0.0
    keeps_eta = extend and _worker_tracks_eta()
    if not extend and delay > vt:
        yield Finding(ERROR, "visibility_vs_eta", settings,
                      {**base, "task": delay_task, "longest_delay": delay},
                      f"a {delay_task} job waits {delay:g}s for its countdown/ETA inside a worker, but kombu "
                      f"re-delivers it after {vt:g}s: every worker then holds a copy until the ETA",
                      "set lease_extend_visibility = True, or raise visibility_timeout above the longest "
                      "countdown")
    elif not keeps_eta and delay > vt:
        yield Finding(ERROR, "visibility_vs_eta", (VT,),
                      {**base, "task": delay_task, "longest_delay": delay, "celery": celery.__version__},
                      f"a {delay_task} job waits {delay:g}s for its countdown/ETA inside a worker, but kombu "
                      f"re-delivers it after {vt:g}s: the visibility refresher keeps ETA messages only from "
                      "Celery 5.7 (an older worker does not list the requests waiting for their ETA), so "
                      "every worker then holds a copy until the ETA",
                      "raise visibility_timeout above the longest countdown, or upgrade Celery to 5.7")
    elif keeps_eta:
        yield Finding(OK, "visibility_vs_eta", settings, {**base, "longest_delay": delay},
                      "ETA messages held by live workers are not re-delivered")
    else:
        yield Finding(OK, "visibility_vs_eta", settings, {**base, "longest_delay": delay},
                      "every countdown/ETA ends inside the visibility timeout")
    takeover = _takeover_after(ctx)
    if extend and vt < takeover:
        yield Finding(WARNING, "visibility_vs_lease", (VT, "lease_duration", "lease_grace_period",
                                                       "lease_worker_stale_after"),
                      {**base, "takeover_after": takeover},
                      f"a dead worker's message comes back after {vt:g}s, before its lease may be taken over "
                      f"({takeover:g}s): the delivery is skipped as a duplicate and the job waits for the "
                      "reaper",
                      f"raise visibility_timeout to at least {takeover:g}s, or shorten "
                      "lease_worker_stale_after")
    else:
        yield Finding(OK, "visibility_vs_lease", (VT, "lease_duration"), {**base, "takeover_after": takeover},
                      "a dead worker's messages come back when their leases can be taken over")


def _worker_tracks_eta() -> bool:
    """Whether the worker lists the requests waiting for their ETA, which the visibility refresher reads.

    ``celery.worker.state.scheduled_requests`` first exists in Celery 5.7.
    """
    from celery.worker import state

    return hasattr(state, "scheduled_requests")


def _rabbitmq(ctx: Context) -> Iterator[Finding]:
    queues = {t.name: ctx.queue(t) or ctx.conf.task_default_queue for t in ctx.tasks}
    timeouts = rabbitmq_consumer_timeouts(ctx.app, queues.values(), ctx.cfg.rabbitmq_consumer_timeout)
    settings = ("consumer_timeout", "lease_rabbitmq_consumer_timeout", "task_time_limit", "lease_max_runtime")
    problems, unbounded = [], []
    for task in ctx.tasks:
        expected, sources = ctx.expected_runtime(task)
        timeout, source = timeouts[queues[task.name]]
        if expected is None:
            unbounded.append(task.name)
        elif expected > timeout:
            problems.append(Finding(
                ERROR, "consumer_timeout", settings,
                {"task": task.name, "queue": queues[task.name], "consumer_timeout": timeout, "source": source,
                 **sources},
                f"task {task.name} may run {expected:g}s but RabbitMQ closes the channel of a consumer that "
                f"holds a delivery unacknowledged for {timeout:g}s: the job is re-delivered and the worker "
                "reconnects, dropping the messages it prefetched",
                f"raise consumer_timeout (rabbitmq.conf, in ms) above {expected:g}s or per queue with the "
                "x-consumer-timeout argument; or lower the task's time_limit / lease_max_runtime below it"))
    if unbounded:
        problems.append(Finding(
            WARNING, "consumer_timeout", settings, {"tasks": unbounded, "consumer_timeouts": timeouts},
            "these tasks have no time_limit, lease_max_runtime or measured runs: one that runs longer than "
            "consumer_timeout makes RabbitMQ close the worker's channel",
            "set time_limit (or lease_max_runtime) below consumer_timeout"))
    yield from ok_unless(problems, "consumer_timeout", settings, {"consumer_timeouts": timeouts},
                          "every task ends before RabbitMQ's consumer_timeout")
    # A worker holds an ETA/countdown message unacknowledged until its time, so consumer_timeout counts
    # from its delivery; the closed channel re-delivers every unacked message, running acks_late jobs too.
    eta_settings = ("consumer_timeout", "lease_rabbitmq_consumer_timeout")
    waits = []
    for task in ctx.tasks:
        delay = float(ctx.task_facts(task).get("longest_delay") or 0.0)
        timeout, source = timeouts[queues[task.name]]
        if delay > timeout:
            waits.append(Finding(
                ERROR, "consumer_timeout_eta", eta_settings,
                {"task": task.name, "queue": queues[task.name], "consumer_timeout": timeout, "source": source,
                 "longest_delay": delay},
                f"a {task.name} job waits {delay:g}s for its countdown/ETA inside a worker, unacknowledged, "
                "but RabbitMQ closes the channel of a consumer that holds a delivery unacknowledged for "
                f"{timeout:g}s: every unacknowledged message on it, running acks_late jobs included, is "
                "delivered again",
                f"raise consumer_timeout (rabbitmq.conf, in ms) above {delay:g}s or per queue with the "
                f"x-consumer-timeout argument; or keep {task.name}'s countdowns/ETAs below {timeout:g}s"))
    yield from ok_unless(waits, "consumer_timeout_eta", eta_settings, {"consumer_timeouts": timeouts},
                         "every countdown/ETA comes due before RabbitMQ's consumer_timeout")
    yield from quorum_rules(ctx)


def sqs_queue_attributes(app: Any, queues: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Each queue's ``VisibilityTimeout`` and redrive ``maxReceiveCount``, or ``{"error": ...}``."""
    try:
        import boto3  # the SQS transport's own dependency
        from botocore.config import Config
        from kombu.transport.SQS import CHARS_REPLACE_TABLE
    except ImportError as exc:
        return {queue: {"error": f"{exc}: pip install celery-lease[sqs]"} for queue in queues}

    options = app.conf.broker_transport_options or {}
    connection = app.connection_for_read()
    host, port = connection.hostname, connection.port
    userid, password = connection.userid or None, connection.password or None
    connection.release()
    secure = options.get("is_secure")
    endpoint = None  # as kombu's Channel.endpoint_url: the URL's host and port, http unless is_secure
    if host:
        endpoint = f"{'https' if secure else 'http'}://{host}" + (f":{port}" if port else "")
    bounded = Config(connect_timeout=SQS_TIMEOUT, read_timeout=SQS_TIMEOUT, retries={"total_max_attempts": 1})
    client = boto3.client("sqs", region_name=options.get("region") or "us-east-1", endpoint_url=endpoint,
                          use_ssl=secure is not False, aws_access_key_id=userid,
                          aws_secret_access_key=password, config=bounded)
    predefined = options.get("predefined_queues") or {}
    found: dict[str, dict[str, Any]] = {}
    for queue in sorted(set(queues)):
        try:
            url = (predefined.get(queue) or {}).get("url") or client.get_queue_url(
                QueueName=str(options.get("queue_name_prefix", "") + queue).translate(CHARS_REPLACE_TABLE)
            )["QueueUrl"]
            attributes = client.get_queue_attributes(
                QueueUrl=url, AttributeNames=["VisibilityTimeout", "RedrivePolicy"])["Attributes"]
        except Exception as exc:  # noqa: BLE001 - botocore's errors have no common base worth naming
            log.debug("SQS queue %s not readable: %s", queue, exc)
            found[queue] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        redrive = json.loads(attributes.get("RedrivePolicy") or "{}")
        found[queue] = {"visibility_timeout": float(attributes["VisibilityTimeout"]),
                        "max_receive_count": int(redrive["maxReceiveCount"]) if redrive else None}
    return found


def _sqs(ctx: Context) -> Iterator[Finding]:
    options = ctx.conf.broker_transport_options or {}
    vt = float(options.get("visibility_timeout", SQS_DEFAULT_VISIBILITY))
    name, longest, sources = _longest(ctx)
    values = {"visibility_timeout": vt, "lease_extend_visibility": ctx.cfg.extend_visibility}
    if not ctx.cfg.extend_visibility and longest is not None and longest > vt:
        yield Finding(WARNING, "sqs_visibility", (VT, "lease_extend_visibility"),
                      {**values, "task": name, **sources},
                      f"task {name} may run {longest:g}s; SQS makes its message visible again after {vt:g}s",
                      "set lease_extend_visibility = True (ChangeMessageVisibility while leased), or raise "
                      "visibility_timeout")
    else:
        yield Finding(OK, "sqs_visibility", (VT, "lease_extend_visibility"), values,
                      "held messages get ChangeMessageVisibility while leased" if ctx.cfg.extend_visibility
                      else "every run ends inside the visibility timeout")
    yield from _sqs_ceiling(ctx)
    yield from _sqs_queues(ctx, vt)


def _sqs_ceiling(ctx: Context) -> Iterator[Finding]:
    """A job longer than 12 hours outlives any visibility SQS grants its message."""
    settings = ("lease_max_runtime", "task_time_limit")
    problems = []
    for task in ctx.tasks:
        expected, sources = ctx.expected_runtime(task)
        if expected is not None and expected > SQS_MAX_VISIBILITY:
            problems.append(Finding(
                WARNING, "sqs_visibility_ceiling", settings,
                {"task": task.name, "ceiling": SQS_MAX_VISIBILITY, **sources},
                f"task {task.name} may run {expected:g}s, past SQS's 12-hour visibility ceiling "
                f"({SQS_MAX_VISIBILITY:g}s from receipt): ChangeMessageVisibility cannot hide its message "
                "longer, so a copy is delivered while it runs (the lease skips it; it counts as a receive)",
                "keep time_limit / lease_max_runtime under 12 hours: split the job, resuming from "
                "self.lease.checkpoint()"))
    yield from ok_unless(problems, "sqs_visibility_ceiling", settings, {"ceiling": SQS_MAX_VISIBILITY},
                         "every task ends inside SQS's 12-hour visibility ceiling")


def _sqs_queues(ctx: Context, kombu_vt: float) -> Iterator[Finding]:
    """Each queue as SQS has it: its visibility against the refresh, its redrive against the lease."""
    queues = {t.name: ctx.queue(t) or ctx.conf.task_default_queue for t in ctx.tasks}
    attributes = sqs_queue_attributes(ctx.app, queues.values())
    settings = ("VisibilityTimeout", "maxReceiveCount", "lease_max_attempts")
    refresh = kombu_vt / REFRESH_SHARE
    findings = []
    for queue in sorted(set(queues.values())):
        found, tasks = attributes[queue], sorted(t for t, q in queues.items() if q == queue)
        if "error" in found:
            findings.append(Finding(
                WARNING, "sqs_queue", settings, {"queue": queue, **found},
                f"queue {queue}: its attributes could not be read, so its visibility timeout and redrive "
                "policy are not checked",
                "run `lease check` where the broker is reachable, with sqs:GetQueueUrl and "
                "sqs:GetQueueAttributes allowed"))
            continue
        queue_vt, receives = found["visibility_timeout"], found["max_receive_count"]
        values = {"queue": queue, "queue_visibility_timeout": queue_vt, "max_receive_count": receives}
        if ctx.cfg.extend_visibility and queue_vt <= refresh:
            findings.append(Finding(
                ERROR, "sqs_queue", settings, {**values, VT: kombu_vt, "refresh_every": refresh},
                f"queue {queue} hides a received message for {queue_vt:g}s, but the visibility is first "
                f"extended {refresh:g}s after receipt ({VT} / {REFRESH_SHARE}): every message of a job "
                "longer than that is delivered again",
                f"set {VT} to the queue's VisibilityTimeout ({queue_vt:g}), or raise the queue's "
                f"VisibilityTimeout above {refresh:g}s"))
        for name in tasks:
            policy = ctx.policies.get(name)
            if policy is None:
                continue
            attempts = policy.max_attempts
            expected, _ = ctx.expected_runtime(next(t for t in ctx.tasks if t.name == name))
            row = {**values, "task": name, "lease_max_attempts": attempts}
            if receives is None:
                findings.append(Finding(
                    OK, "sqs_queue", settings, row,
                    f"task {name}: no redrive policy on {queue}; the lease dead-letters the job after "
                    f"{attempts} attempts"))
                continue
            if not ctx.cfg.extend_visibility and expected is not None:
                per_run = max(1, math.ceil(expected / queue_vt))
                if per_run > receives:  # receive number maxReceiveCount + 1 goes to the DLQ
                    findings.append(Finding(
                        ERROR, "sqs_queue", settings, {**row, "receives_per_run": per_run},
                        f"task {name}: SQS ends the job first: without the extension one run of "
                        f"{expected:g}s is received {per_run} times ({queue_vt:g}s visibility), and SQS "
                        f"moves the message to its dead-letter queue after {receives} receives, mid-run",
                        "set lease_extend_visibility = True"))
                    continue
            if receives <= attempts:
                findings.append(Finding(
                    WARNING, "sqs_queue", settings, row,
                    f"task {name}: SQS ends the job first: it moves the message to its dead-letter queue "
                    f"after {receives} receives, and every lost run (and every copy the lease skips) is one "
                    f"receive, while the lease allows {attempts} attempts; the reaper then sends the job "
                    "again while a copy sits in SQS's dead-letter queue",
                    f"raise the queue's maxReceiveCount above lease_max_attempts ({attempts}), or lower "
                    f"lease_max_attempts below {receives}"))
            else:
                findings.append(Finding(
                    OK, "sqs_queue", settings, row,
                    f"task {name}: the lease ends the job first: it dead-letters after {attempts} attempts, "
                    f"before SQS's redrive after {receives} receives"))
    yield from findings


def _other(ctx: Context, kind: str) -> Iterator[Finding]:
    if kind in DEMO_TRANSPORTS:
        yield Finding(OK, "broker_visibility", ("broker_url",), {"transport": kind},
                      f"the {kind} transport has no redelivery timeout (a demo transport: use Redis or "
                      "RabbitMQ in production)")
        return
    yield Finding(WARNING, "broker_visibility", ("broker_url",), {"transport": kind},
                  f"celery_lease cannot extend the visibility of the {kind} transport's messages: a job "
                  "longer than its redelivery timeout is delivered again (the lease skips the copy)",
                  "make the transport's redelivery timeout longer than the longest task")

