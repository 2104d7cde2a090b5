"""A LeaseTask's publish: the message is encoded once inside ``producer.publish``, exactly as kombu would,
recorded with its job, and those same bytes sent, so the stored message is the sent one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery._state import get_current_worker_task

import celery_lease.deadline as deadline
import celery_lease.messaging.messages as messages
import celery_lease.publish.batching as batching
import celery_lease.publish.replacing as replacing
import celery_lease.worker.deliveries as deliveries
import celery_lease.worker.runtime as runtime

from ..config import task_policy
from ..context import BODY
from ..deadline import seconds_until
from ..errors import LeaseError, StoreRejected, StoreUnavailable
from ..store import NewJob, for_app
from ..vocabulary import StoreFailure
from ..worker.checkpoints import held_back_first
from ..worker.lease import Lease

__all__ = ["RecordingProducer", "publish", "record_eager", "seconds_until"]

log = logging.getLogger(__name__)


class _KeyTaken(LeaseError):  # noqa: N818 - a signal inside publish(), never seen by users
    """Raised by the publish record to stop the send: the idempotency key belongs to ``holder``."""

    holder: str

    def __init__(self, holder: str) -> None:
        super().__init__(f"idempotency key belongs to job {holder}", holder=holder)


def publish(task: Any, send: Callable[..., Any], args: Any, kwargs: Any, task_id: str, producer: Any,
            link: Any, link_error: Any, shadow: Any, idempotency_key: str | None,
            options: dict[str, Any]) -> Any:
    """Publish through Celery's ``apply_async`` (``send``), recording the job (a hand-over, the running job's
    own retry, or a new job once per key) with the message it sends."""
    # As Celery's message: a countdown, when given, overrides the eta.
    countdown = options.get("countdown")
    delay = seconds_until(countdown) if countdown else seconds_until(options.get("eta"))
    record: Callable[[str], bool | None]
    keep: Callable[[str, Callable[[Any], Any]], None] | None = None
    created, retrying = False, None
    batch = batching.current()
    if replacing.hands_over_to(task_id):
        def record(payload: str) -> None:
            replacing.claim_on_publish(task, task_id, payload)
    elif (lease := runtime.own_lease(task)) is not None and lease.job_id == task_id and not (
            lease.lost or lease.handed_over):
        # Task.retry(): the row becomes pending first, so the new message finds it claimable.
        retrying = lease

        def record(payload: str) -> bool:
            return retry_first(lease, delay, payload)
    else:
        # Routed as Celery's send_task routes it: the task's own options under the call's, the task passed.
        route = task.app.amqp.router.route(dict(task._get_exec_options(), **options), task.name, args, kwargs,
                                           task)
        queue = getattr(route.get("queue"), "name", None)
        policy = task_policy(task, queue)
        store = for_app(task.app)

        def record(payload: str) -> None:
            nonlocal created
            # This thread's own transaction.atomic() on the SQLite file the store shares: a record would wait
            # on that transaction, which waits on this publish. Sent unrecorded at once, as plain Celery sends
            # it (its claim records it); a key needs its record, which may still go through.
            own = _own_transaction_holds(store)
            if own and idempotency_key is None:
                log.warning("task %s [%s] sent unrecorded: this thread's transaction.atomic() holds the "
                            "SQLite file the lease store shares (delay_on_commit() records it first); its "
                            "claim records it", task.name, task_id, extra={"action": "published_unrecorded"})
                return
            try:
                created, holder = replacing.record_step(store, task_id, task.name, queue, payload,
                                                        policy.max_attempts, idempotency_key, delay,
                                                        policy.recovery(), _reopens(task_id))
            except (StoreUnavailable, StoreRejected) as exc:
                if own and isinstance(exc, StoreUnavailable):
                    raise StoreRejected(
                        f"task {task.name}: its idempotency key cannot be recorded inside this thread's "
                        "transaction.atomic(), which holds the SQLite file the lease store shares; publish "
                        "with apply_async_on_commit() (recorded once the transaction commits)",
                        kind=StoreFailure.LOCKED_BY_CALLER) from exc
                if idempotency_key is not None or not _after_a_body():
                    # The record may have committed unanswered: once the body ends, the job it was told is
                    # unpublished is deleted if never sent. Not a keyed one: its key may have answered
                    # another publish with it by then, and it answers the body's next run.
                    if isinstance(exc, StoreUnavailable) and idempotency_key is None and (
                            parent := BODY.get()) is not None:
                        parent.unsent.append(task_id)
                    raise
                # Raising would drop the rest of the canvas (maybe a replaced job): its claim records it.
                refused = isinstance(exc, StoreRejected)
                (log.error if refused else log.warning)(
                    "task %s [%s] sent unrecorded, the store %s (%s); its claim records it", task.name,
                    task_id, "refused its record" if refused else "is unreachable", exc,
                    extra={"action": "published_unrecorded"})
                return
            if holder != task_id or (idempotency_key is not None and not created):
                # Not created under its key: the key's job, this very id when it was reused, is sent already.
                raise _KeyTaken(holder)

        # After a body (Celery's post-run work, a plain task), or inside a transaction holding the store's
        # SQLite file, each job is recorded alone: sent unrecorded as above, where a batch would drop the
        # whole group.
        if batch is not None and idempotency_key is None and task.app.conf.task_protocol != 1 and not (
                _after_a_body() or _own_transaction_holds(store)):
            reopen = _reopens(task_id)

            def keep(payload: str, send_message: Callable[[Any], Any]) -> None:
                batch.keep(task.app, store, NewJob(task_id, task.name, queue, payload, policy.max_attempts,
                                                   delay, policy.recovery()), reopen, send_message)
    if batch is not None and keep is None:
        batch.flush()  # the group's order: the jobs kept so far go out before this one
    recording: RecordingProducer | None = None
    connection = options.pop("connection", None)
    if connection and producer is None:
        producer = task.app.amqp.Producer(connection, auto_declare=False)
    try:
        if task.app.conf.task_protocol == 1:
            # Protocol 1 carries the task id in the body: the signature is recorded instead.
            serializer = options.get("serializer") or task.serializer
            signature = messages.encode(task.name, args, kwargs, {
                **options, "link": link, "link_error": link_error, "shadow": shadow}, serializer)
            if record(signature) is False:
                return task.AsyncResult(task_id)  # held back: sent once the store answers
            return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        with task.app.producer_or_acquire(producer) as sender:
            recording = RecordingProducer(sender, task_id, record, keep)
            result = send(args, kwargs, task_id, recording, link, link_error, shadow, **options)
        if keep is None and (parent := BODY.get()) is not None and task_id in parent.unsent:
            parent.unsent.remove(task_id)  # published again under its id and sent: not to be forgotten
        return result
    except _KeyTaken as taken:
        if taken.holder != task_id and any(options.get(name) for name in ("group_id", "chord", "chain")):
            # Not raised: a body retried publishes its keyed canvas again, and must not fail on its own keys.
            log.warning("task %s [%s]: idempotency key %r belongs to job %s, so this canvas member is not "
                        "published; its group, chain or chord waits on %s, which nothing will run",
                        task.name, task_id, idempotency_key, taken.holder, task_id,
                        extra={"action": "idempotent_canvas_member"})
        log.info("task %s not published again: idempotency key %r belongs to job %s",
                 task.name, idempotency_key, taken.holder, extra={"action": "idempotent_publish"})
        return task.AsyncResult(taken.holder)
    except BaseException:
        # Not once the message went out: Celery's task-sent event, published after it, may be what failed,
        # and the job then runs (under its key, which a caller's retry must find).
        sent = recording is not None and recording.sent
        if created and not sent and not for_app(task.app).publishes.forget_unpublished(task_id) and (
                idempotency_key is not None):
            log.warning("task %s [%s]: its message was not sent, but its record under idempotency key %r "
                        "stays (another publish was answered with it, or it was claimed or re-sent since); "
                        "while pending, the dispatch scan sends it after lease_dispatch_timeout", task.name,
                        task_id, idempotency_key,
                        extra={"action": "keyed_publish_kept"})
        if retrying is not None and retrying.retried and not sent:
            retrying.retry_unsent = True  # Celery's retry() turns this into a final Reject
        raise


def record_eager(task: Any, task_id: str, idempotency_key: str, options: dict[str, Any]) -> tuple[bool, str]:
    """An eager run's record under ``idempotency_key``: (True, its id) to run it, or (False, the key's
    existing job), which the run must not repeat."""
    queue = options.get("queue")
    queue = getattr(queue, "name", queue)
    policy = task_policy(task, queue)
    created, holder = for_app(task.app).publishes.record(task_id, task.name, queue, None, policy.max_attempts,
                                                         idempotency_key, 0.0, recovery=policy.recovery())
    if not created:
        log.info("task %s not run again: idempotency key %r belongs to job %s", task.name, idempotency_key,
                 holder, extra={"action": "idempotent_publish"})
        return False, holder
    return True, task_id


def retry_first(lease: Lease, delay: float, payload: str) -> bool:
    """running -> pending under the token before the retry's message is sent; LeaseLost if it moved on. An
    unreachable store holds the message back (False) for the settle step."""
    with lease.turn:
        def write() -> bool:
            return lease.store.jobs.retry_later(lease.job_id, lease.token, delay, payload, None, lease.worker)

        if lease.pending_checkpoint is not None:  # the retry's attempt resumes from it
            write = held_back_first(lease, write)
        try:
            written = write() or (lease.vanished_and_recorded_again() and write())
        except StoreUnavailable as exc:
            log.warning("job %s [%s]: retry held back until the store answers (%s)", lease.job_id,
                        lease.token[:8], exc, extra={"action": "retry_deferred"})
            lease.deferred_retry = (deadline.monotonic() + delay, payload)
            return False
        if not written:
            lease.mark_lost("retry rejected: token no longer matches")
            lease.check()
        lease.retried = True
    return True


def _own_transaction_holds(store: Any) -> bool:
    """Whether the store is a SQLite file this thread's own Django transaction holds: its record waits on
    itself, which is no outage."""
    from ..store.django_database import holds_store_file

    return holds_store_file(store)


def _after_a_body() -> bool:
    """Whether this publish comes from a worker's task outside any leased body (Celery's post-run work, or a
    plain task)."""
    current = get_current_worker_task()
    return current is not None and runtime.own_lease(current) is None


def _reopens(task_id: str) -> bool:
    """Whether publishing ``task_id`` runs a finished job of that id again, as Celery would: not from the
    job's own run, nor while a crash's post-run work is resumed."""
    current = get_current_worker_task()
    if current is None:
        return True
    current_id = current.request.id
    return current_id != task_id and not deliveries.resumed(current_id)


class RecordingProducer:
    """Wraps a kombu producer for one ``apply_async``; everything but the task's publish passes through."""

    def __init__(self, producer: Any, task_id: str, record: Callable[[str], bool | None],
                 keep: Callable[[str, Callable[[Any], Any]], None] | None = None) -> None:
        self._producer = producer
        self._task_id = task_id
        self._record = record
        self._keep = keep  # a group's batch: it records the job and sends the message later
        self._recorded = False
        #: Whether the task's own message reached the broker (a batch's is sent later, by the batch).
        self.sent = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        headers = kwargs.get("headers")
        # The producer also sends the task-sent event and retried callbacks: record the task's own, once.
        if self._recorded or not headers or headers.get("id") != self._task_id:
            return self._producer.publish(body, **kwargs)
        producer = self._producer
        compression = kwargs.pop("compression", None)
        compression = producer.compression if compression is None else compression
        data, content_type, content_encoding = producer._prepare(
            body, kwargs.pop("serializer", None), kwargs.pop("content_type", None),
            kwargs.pop("content_encoding", None), compression, headers)
        payload = messages.capture(data, content_type, content_encoding, kwargs)
        self._recorded = True

        def send_message(sender: Any) -> Any:
            return sender.publish(data, content_type=content_type, content_encoding=content_encoding,
                                  compression="", **kwargs)

        if self._keep is not None:
            self._keep(payload, send_message)
            return None
        if self._record(payload) is False:
            return None  # held back: the record's owner sends it later
        result = send_message(producer)
        self.sent = True
        return result
