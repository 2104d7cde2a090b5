"""A group's LeaseTask jobs recorded a batch at a time, before their messages are sent.

Celery's ``group`` (and so a chord's header) sends each signature through its task's own
``apply_async``, one after another, inside ``group._apply_tasks``: the one place that sees the
whole group. install() wraps it to open a batch for its loop. Inside, the publish of a new
LeaseTask job without an idempotency key keeps its encoded message instead of recording and
sending it. The kept jobs are recorded with one INSERT per table per RECORD_BATCH jobs
(store.record_batch), then their messages are sent in the group's order: when the loop ends,
or once the oldest kept job has waited BATCH_WAIT (a timer thread), since Celery sends the
signatures of a generator as it yields them and the generator may wait for the tasks sent
before (celery#3021). A publish with a key, a retry or a replacement sends the jobs kept so
far first, then goes as before, so the order of the messages is the group's.

If the loop fails, what it kept is dropped and Celery raises from ``apply_async`` as before.
If a batch finds an id the store knows (a frozen group applied again), its jobs are recorded
one by one, each as a single publish would be. If a batch cannot be recorded, or a message
cannot be sent, the records it made for the unsent messages are deleted, as a single publish
deletes its own, and the error leaves ``apply_async`` (from a background flush: at the next
publish of the loop or when it ends).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..context import BATCH as _current
from ..errors import StoreConflict
from ..store import NewJob, WorkerStore

__all__ = ["Batch", "current", "install"]

# Seconds a kept job waits at most for the rest of its batch.
BATCH_WAIT = 0.05


@dataclasses.dataclass
class _Kept:
    """One job of the batch: its record, whether publishing its id may reopen a finished job, and
    the send of its message (given a producer of its app)."""

    app: Any
    store: WorkerStore
    job: NewJob
    reopen: bool
    send: Callable[[Any], Any]


class Batch:
    """The LeaseTask publishes of one group's loop, kept for at most BATCH_WAIT seconds each."""

    def __init__(self) -> None:
        self._kept: list[_Kept] = []
        self._lock = threading.Lock()  # guards _kept, _timer and _error
        self._sending = threading.Lock()  # one flush at a time, so messages leave in order
        self._timer: threading.Timer | None = None
        self._error: BaseException | None = None

    def keep(self, app: Any, store: WorkerStore, job: NewJob, reopen: bool,
             send: Callable[[Any], Any]) -> None:
        with self._lock:
            self._raise_failure()
            self._kept.append(_Kept(app, store, job, reopen, send))
            if self._timer is None:
                # A generator may wait for the tasks already sent (celery#3021): a kept job
                # goes out within BATCH_WAIT whatever the loop does meanwhile.
                self._timer = threading.Timer(BATCH_WAIT, self._flush_in_background)
                self._timer.daemon = True
                self._timer.start()

    def close(self) -> None:
        """The group's loop ended: send what is kept, and raise what a background flush met."""
        self.flush()
        with self._lock:
            self._raise_failure()

    def discard(self) -> None:
        """The group's loop failed: drop what is kept (a batch already on its way completes)."""
        with self._lock:
            self._kept.clear()
            self._error = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def flush(self) -> None:
        """Record the kept jobs (a batch per store), then send their messages in order."""
        with self._sending:
            with self._lock:
                kept, self._kept = self._kept, []
                timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()  # a no-op when it is the timer's own thread that flushes
            if kept:
                _record_and_send(kept)

    def _flush_in_background(self) -> None:
        try:
            self.flush()
        except BaseException as exc:  # noqa: BLE001 - handed to the publishing thread, raised there
            with self._lock:
                self._error = self._error or exc

    def _raise_failure(self) -> None:
        """Raise (once) what a background flush met; the jobs kept since are dropped, unsent."""
        if self._error is not None:
            error, self._error = self._error, None
            self._kept.clear()
            raise error


def _record_and_send(kept: list[_Kept]) -> None:
    by_store: dict[int, list[_Kept]] = {}
    for item in kept:
        by_store.setdefault(id(item.store), []).append(item)
    created: set[int] = set()
    for items in by_store.values():
        created.update(id(item) for item in _record(items))
    unsent = list(kept)
    try:
        while unsent:
            app = unsent[0].app
            with app.producer_or_acquire() as producer:
                while unsent and unsent[0].app is app:
                    unsent[0].send(producer)
                    unsent.pop(0)
    except BaseException:
        for item in unsent:
            if id(item) in created:
                item.store.forget_unpublished(item.job.id)
        raise


def _record(items: list[_Kept]) -> list[_Kept]:
    """Record ``items`` of one store, as one batch or, when an id is known already, one by one;
    the items whose rows this made (a known id keeps its row and, as a single publish of it
    would, still gets its message)."""
    store = items[0].store
    try:
        store.record_batch([item.job for item in items])
        return items
    except StoreConflict:
        pass
    created = []
    for item in items:
        job = item.job
        new, _ = store.record(job.id, job.task_name, job.queue, job.payload, job.max_attempts, None,
                              job.delay, recovery=job.recovery, reopen=item.reopen)
        if new:
            created.append(item)
    return created


def current() -> Batch | None:
    """The batch of the group being published in this context, if any."""
    return _current.get()


def install() -> None:
    """Wrap ``celery.canvas.group._apply_tasks`` once per process (idempotent)."""
    from celery.canvas import group

    original = group._apply_tasks
    if getattr(original, "_celery_lease_batched", False):
        return

    @functools.wraps(original)
    def _apply_tasks(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if _current.get() is not None:  # a group inside a group's loop joins its batch
            yield from original(self, *args, **kwargs)
            return
        batch = Batch()
        # group.apply_async takes the whole list at once: consuming it here keeps the batch's
        # context to the loop (a generator's frame would share it with the caller between items).
        token = _current.set(batch)
        try:
            results = list(original(self, *args, **kwargs))
        except BaseException:
            batch.discard()
            raise
        finally:
            _current.reset(token)
        batch.close()
        yield from results

    _apply_tasks._celery_lease_batched = True  # type: ignore[attr-defined]
    group._apply_tasks = _apply_tasks
