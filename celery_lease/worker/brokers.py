"""Keep the broker's idea of ownership in step with the lease: kombu's Redis transport restores an unacked
message older than ``visibility_timeout`` even while its worker lives (kombu #337), so the main process
refreshes the messages this live worker holds; a dead one refreshes nothing, and the broker's recovery
still brings its messages back."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from celery import bootsteps
from celery.utils.nodenames import gethostname

from ..config import app_config, task_policy
from ..errors import StoreRejected, StoreUnavailable
from ..kinds import is_lease_task
from .threads import Loop, worker_id

__all__ = ["VisibilityStep", "VisibilityKeeper", "Held", "RedisExtender", "SQSExtender", "extender_for",
           "held_messages", "OwnChannel", "transport_kind"]

log = logging.getLogger(__name__)

REFRESH_SHARE = 4  # refresh every visibility_timeout / 4: well inside kombu's sweep, at most a third
MIN_INTERVAL = 0.05  # seconds
SQS_BATCH = 10  # ChangeMessageVisibilityBatch takes at most ten entries
SCHEME_KINDS = {"pyamqp": "amqp", "amqps": "amqp", "librabbitmq": "amqp", "rediss": "redis",
                "sentinel": "redis", "sqla": "sql"}


@dataclasses.dataclass(frozen=True)
class Held:
    """A message this worker holds: waiting (prefetched or ETA), or running under a lease."""

    job_id: str
    tag: str
    delivery_info: Mapping[str, Any]
    leased: bool = False  # running: refreshed only while the lease of one of ``owners`` is healthy
    owners: tuple[str, ...] = ()  # worker ids the process running it may lock the job as
    duration: float = 0.0  # the job's lease duration, to ride out a store outage


class Extender(Protocol):
    """Pushes back the broker's redelivery of held messages, in as few round trips as it allows."""

    visibility_timeout: float

    def extend(self, held: Sequence[Held]) -> int: ...


class RedisExtender:
    """``ZADD <unacked_index> XX CH <now> <tag> ...``; ``XX`` never resurrects an acked or restored one."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.key = channel.unacked_index_key
        self.visibility_timeout = float(channel.visibility_timeout)

    def extend(self, held: Sequence[Held]) -> int:
        if not held:
            return 0
        now = time.time()  # kombu scores and restores with the local clock too
        with self.channel.conn_or_acquire() as client:
            return int(client.zadd(self.key, {h.tag: now for h in held}, xx=True, ch=True))


class SQSExtender:
    """``ChangeMessageVisibilityBatch``; a receipt handle SQS refuses is logged once, not every round."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.visibility_timeout = float(channel.visibility_timeout)
        self._refused: set[str] = set()

    def extend(self, held: Sequence[Held]) -> int:
        batches: dict[tuple[str | None, str], list[str]] = {}
        for h in held:
            sqs_message, url = h.delivery_info.get("sqs_message"), h.delivery_info.get("sqs_queue")
            if not sqs_message or not url:
                continue
            routing_key = h.delivery_info.get("routing_key")
            queue = self.channel.canonical_queue_name(routing_key) if routing_key else None
            batches.setdefault((queue, url), []).append(sqs_message["ReceiptHandle"])
        changed, refused = 0, set[str]()
        failure: Exception | None = None
        for (queue, url), handles in batches.items():
            for start in range(0, len(handles), SQS_BATCH):
                seconds = int(self.visibility_timeout)
                entries = [{"Id": str(i), "ReceiptHandle": handle, "VisibilityTimeout": seconds}
                           for i, handle in enumerate(handles[start:start + SQS_BATCH])]
                try:
                    reply = self.channel.sqs(queue=queue).change_message_visibility_batch(
                        QueueUrl=url, Entries=entries)
                except Exception as exc:  # noqa: BLE001 - raised once the other queues' batches are sent
                    # One queue's error (throttled, deleted, its region unreachable) must not leave the
                    # messages of every other queue to become visible again this round.
                    if failure is not None:
                        log.warning("visibility of %d messages on %s not extended: %s", len(entries), url,
                                    exc, extra={"action": "visibility_refused"})
                    failure = failure or exc
                    continue
                changed += len(reply.get("Successful", ()))
                for failed in reply.get("Failed", ()):
                    handle = str(entries[int(failed["Id"])]["ReceiptHandle"])
                    refused.add(handle)
                    log.log(logging.DEBUG if handle in self._refused else logging.WARNING,
                            "SQS refused to extend the visibility of a message on %s: %s", url,
                            failed.get("Message") or failed.get("Code"),
                            extra={"action": "visibility_refused"})
        self._refused = refused  # only the handles still held and still refused
        if failure is not None:
            raise failure
        return changed


def extender_for(channel: Any) -> Extender | None:
    """The extender of a kombu channel's transport, or None when it has no visibility timeout."""
    driver = getattr(getattr(channel, "connection", None), "driver_type", None)
    if driver == "redis" and getattr(channel, "ack_emulation", False):
        return RedisExtender(channel)
    if driver == "sqs":
        return SQSExtender(channel)
    return None


def _snapshot(requests: Iterable[Any]) -> list[Any]:
    # The consumer and pool threads add and discard requests while we copy.
    for _ in range(10):
        try:
            return list(requests)
        except RuntimeError:
            continue
    log.debug("worker request sets kept changing; refreshing nothing this round")
    return []


def held_messages() -> list[Held]:
    """This worker's unacked messages: waiting ones, and running LeaseTasks with acks_late."""
    from celery.worker import state

    active = _snapshot(state.active_requests)
    running = {id(r) for r in active}
    held: dict[str, Held] = {}
    # Celery < 5.7 does not track ETA requests: their messages age in unacked_index as in plain Celery.
    scheduled = getattr(state, "scheduled_requests", ())
    for request in [*active, *_snapshot(state.reserved_requests), *_snapshot(scheduled)]:
        message = request.message
        tag = getattr(message, "delivery_tag", None)
        if tag is None or tag in held or message.acknowledged:
            continue
        info = message.delivery_info or {}
        if id(request) not in running:
            held[tag] = Held(request.id, tag, info)
        elif is_lease_task(request.task) and request.worker_pid:
            policy = task_policy(request.task, info.get("routing_key") or None)
            # The node name under `celery worker`; the bare host name in in-process test workers.
            owners = tuple(dict.fromkeys(worker_id(host, request.worker_pid)
                                         for host in (request.hostname, gethostname())))
            held[tag] = Held(request.id, tag, info, leased=True, owners=owners, duration=policy.duration)
    return list(held.values())


@dataclasses.dataclass
class RefreshResult:
    held: int = 0
    leased: int = 0
    not_healthy: int = 0
    extended: int = 0


class VisibilityKeeper:
    """Every ``interval``, extends the broker visibility of the messages this live worker holds. The main
    process learns which leases are healthy from the store; while it is unreachable, a lease seen healthy
    within its duration still counts."""

    def __init__(self, app: Any, connect: Callable[[], Extender | None],
                 collect: Callable[[], list[Held]] = held_messages, store: Any = None) -> None:
        self.app = app
        self.store = store
        self.connect = connect
        self.collect = collect
        self.extender: Extender | None = None
        self.visibility_timeout = 4.0  # until the transport tells: retry a failed connect every second
        self.rounds = 0
        self._confirmed: dict[str, float] = {}
        self._reported: set[str] = set()
        self._loop = Loop("celery-lease-visibility", self._round, self._round_failed)

    @property
    def interval(self) -> float:
        return max(MIN_INTERVAL, self.visibility_timeout / REFRESH_SHARE)

    def run_once(self) -> RefreshResult:
        """Refresh every held message once (one store query, one broker round trip)."""
        if self.extender is None:
            self.extender = self.connect()
            if self.extender is None:
                return RefreshResult()
            self.visibility_timeout = self.extender.visibility_timeout
        held = self.collect()
        leased = [h for h in held if h.leased]
        healthy = self._healthy(leased)
        refresh = [h for h in held if not h.leased or h.job_id in healthy]
        unhealthy = {h.job_id for h in leased if h.job_id not in healthy}
        for job_id in unhealthy - self._reported:
            log.info("job %s: lease not healthy, visibility of its message no longer extended",
                     job_id, extra={"action": "visibility_not_extended"})
        self._reported = unhealthy  # say it once per job while it is held
        result = RefreshResult(len(held), len(leased), len(unhealthy))
        result.extended = self.extender.extend(refresh) if refresh else 0
        self.rounds += 1
        return result

    def _healthy(self, leased: Sequence[Held]) -> set[str]:
        if not leased:
            self._confirmed.clear()
            return set()
        from ..store import for_app

        now = time.monotonic()
        try:
            store = self.store or for_app(self.app, check=False)
            owners = store.deliveries.leases_alive([h.job_id for h in leased])
        except (StoreUnavailable, StoreRejected) as exc:
            log.warning("visibility refresh cannot reach the lease store (%s); trusting leases seen "
                        "within their duration", exc, extra={"action": "visibility_store_unavailable"})
            return {h.job_id for h in leased if now - self._confirmed.get(h.job_id, -1e18) < h.duration}
        healthy = {h.job_id for h in leased if owners.get(h.job_id) in h.owners}
        self._confirmed = {job_id: now for job_id in healthy}
        return healthy

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._loop.stop(timeout)
        self.extender = None
        close = getattr(self.connect, "close", None)
        if close is not None:
            close()

    def _round(self) -> float:
        self.run_once()
        return self.interval

    def _round_failed(self) -> float:
        log.exception("visibility refresh round failed; reconnecting")
        self.extender = None
        return self.interval


class OwnChannel:
    """The keeper's own broker connection: the consumer's channel belongs to the consumer's thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.connection: Any = None

    def __call__(self) -> Extender | None:
        self.close()
        self.connection = self.app.connection_for_read()
        return extender_for(self.connection.default_channel)

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.release()


def transport_kind(app: Any) -> str:
    """The broker transport's driver type (redis, amqp, sqs, sql, filesystem, memory ...)."""
    try:
        connection = app.connection_for_read()
        try:
            return str(connection.transport.driver_type)
        finally:
            connection.release()
    except (ImportError, RuntimeError):
        # The transport's client library is not installed here; its URL still names it.
        scheme = urlsplit(str(app.conf.broker_url or "amqp://")).scheme.split("+")[0].lower()
        return SCHEME_KINDS.get(scheme, scheme)


class VisibilityStep(bootsteps.StartStopStep):
    """Consumer step of the main process: keeps held messages invisible to kombu's restore."""

    label = "celery_lease visibility"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.keeper: VisibilityKeeper | None = None
        super().__init__(c, **kwargs)

    def include_if(self, c: Any) -> bool:
        if not app_config(c.app).extend_visibility:
            return False
        return transport_kind(c.app) in ("redis", "sqs")

    def start(self, c: Any) -> None:
        if self.keeper is None:
            self.keeper = VisibilityKeeper(c.app, OwnChannel(c.app))
        self.keeper.start()

    def stop(self, c: Any) -> None:
        """Keep the keeper: a warm shutdown stops the consumer's steps before the pool drains, and the jobs
        still running need their messages kept. On its own connection, it also outlives a consumer restarted
        after a lost broker connection (start() finds it running)."""

    def shutdown(self, c: Any) -> None:
        # Called once the pool has drained (the worker's on_stopped).
        if self.keeper is not None:
            self.keeper.stop()
