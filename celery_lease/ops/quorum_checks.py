"""``lease check`` on RabbitMQ quorum queues: their delivery limit against ``lease_max_attempts``.

From RabbitMQ 4.0 a quorum queue drops a message after 20 deliveries by default.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from .check_context import WARNING, Context, Finding, ok_unless

__all__ = ["quorum_rules", "queue_delivery_limits", "RABBITMQ4_DELIVERY_LIMIT"]

log = logging.getLogger(__name__)

RABBITMQ4_DELIVERY_LIMIT = 20  # deliveries: a quorum queue's default x-delivery-limit from RabbitMQ 4.0
CONNECT_TIMEOUT = 2.0  # seconds: reading the server's version


def server_major(app: Any) -> int | None:
    """RabbitMQ's major version from the connection's server properties; None when unreachable."""
    try:
        with app.connection_for_read(connect_timeout=CONNECT_TIMEOUT) as connection:
            connection.ensure_connection(max_retries=1)
            version = connection.connection.server_properties.get("version", b"")
    except Exception as exc:  # noqa: BLE001 - a check reports an unreachable broker, it does not fail
        log.debug("RabbitMQ version not read: %s", exc)
        return None
    text = version.decode() if isinstance(version, bytes) else str(version)
    head = text.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def queue_delivery_limits(app: Any, queues: set[str], major: int | None) -> dict[str, tuple[int | None, str]]:
    """Each declared quorum queue's delivery limit (None: unlimited) and where it comes from."""
    limits: dict[str, tuple[int | None, str]] = {}
    for name, queue in app.amqp.queues.items():
        arguments = queue.queue_arguments or {}
        if name not in queues or arguments.get("x-queue-type") != "quorum":
            continue
        if arguments.get("x-delivery-limit") is not None:
            limits[name] = (int(arguments["x-delivery-limit"]), "x-delivery-limit")
        elif major is None:
            limits[name] = (RABBITMQ4_DELIVERY_LIMIT, "RabbitMQ 4 default (server version unknown)")
        elif major >= 4:
            limits[name] = (RABBITMQ4_DELIVERY_LIMIT, f"RabbitMQ {major} default")
        else:
            limits[name] = (None, f"RabbitMQ {major}: no default limit")
    return limits


def quorum_rules(ctx: Context) -> Iterator[Finding]:
    """A warning per quorum queue whose delivery limit ends a job before ``lease_max_attempts`` does."""
    queues = {t.name: ctx.queue(t) or ctx.conf.task_default_queue for t in ctx.tasks}
    quorum = {q for q in queues.values()
              if (ctx.app.amqp.queues.get(q) is not None
                  and (ctx.app.amqp.queues[q].queue_arguments or {}).get("x-queue-type") == "quorum")}
    if not quorum:
        return
    limits = queue_delivery_limits(ctx.app, quorum, server_major(ctx.app))
    settings = ("x-delivery-limit", "lease_max_attempts")
    problems = []
    for task in ctx.tasks:
        limit, source = limits.get(queues[task.name], (None, ""))
        policy = ctx.policies.get(task.name)
        if limit is None or policy is None or limit + 1 >= policy.max_attempts:
            continue
        problems.append(Finding(
            WARNING, "quorum_delivery_limit", settings,
            {"task": task.name, "queue": queues[task.name], "x-delivery-limit": limit, "source": source,
             "lease_max_attempts": policy.max_attempts},
            f"quorum queue {queues[task.name]} stops delivering a message after {limit + 1} deliveries, "
            f"before the lease's {policy.max_attempts} attempts of {task.name} run out: the queue ends the "
            "job first, the reaper re-sends it only after its lease expires, and a dead-letter exchange "
            "gets a copy of a job that is still alive",
            f"declare the queue with x-delivery-limit >= {policy.max_attempts - 1}, or lower "
            f"lease_max_attempts to {limit + 1}"))
    yield from ok_unless(problems, "quorum_delivery_limit", settings,
                         {"delivery_limits": {q: limit for q, (limit, _) in limits.items()}},
                         "every quorum queue redelivers a job at least as often as the lease retries it")
