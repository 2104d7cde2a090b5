"""A group's LeaseTask jobs recorded a batch at a time, before their messages are sent.

install() wraps ``group._apply_tasks`` (Celery 5.3 to 5.7: a generator function over ``(self, tasks,
producer, app)``), the one place that sees the whole group; another shape is left alone, one WARNING
logged, and jobs publish one by one. Kept jobs go out in the group's order when the loop ends or after
BATCH_WAIT, since a generator may wait for the tasks sent before (celery#3021). A batch that fails
deletes the records of its unsent messages, as a single publish does."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextvars import Token
from typing import Any

import celery
from celery.canvas import Signature, group, maybe_signature

from ..context import BATCH as _current
from ..context import BODY
from ..errors import StoreConflict, StoreUnavailable
from ..kinds import leased
from ..store import NewJob, Store

__all__ = ["Batch", "current", "install"]

log = logging.getLogger(__name__)

BATCH_WAIT = 0.05  # seconds a kept job waits at most for the rest of its batch

# Passed on by position: first in ``group._apply_tasks``'s signature on Celery 5.3 to 5.7.
_KNOWN_HEAD = ("self", "tasks", "producer", "app")


@dataclasses.dataclass
class _Kept:
    """One job of the batch: its record, whether its id may reopen a finished job, and its message's send."""

    app: Any
    store: Store
    job: NewJob
    reopen: bool
    send: Callable[[Any], Any]
    parent: Any = None  # the lease of the body that publishes it (the timer's thread has no context)


class Batch:
    """The LeaseTask publishes of one group's loop, kept for at most BATCH_WAIT seconds each."""

    def __init__(self) -> None:
        self._kept: list[_Kept] = []
        self._lock = threading.Lock()  # guards _kept, _timer and _error
        self._sending = threading.Lock()  # one flush at a time, so messages leave in order
        self._timer: threading.Timer | None = None
        self._error: BaseException | None = None

    def keep(self, app: Any, store: Store, job: NewJob, reopen: bool,
             send: Callable[[Any], Any]) -> None:
        with self._lock:
            self._raise_failure()
            self._kept.append(_Kept(app, store, job, reopen, send, BODY.get()))
            if self._timer is None:
                # A generator may wait for the tasks already sent (celery#3021).
                self._timer = threading.Timer(BATCH_WAIT, self._flush_in_background)
                self._timer.daemon = True
                self._timer.start()

    def close(self) -> None:
        """The group's loop ended: send what is kept, and raise what a background flush met."""
        self.flush()
        with self._lock:
            self._raise_failure()

    def send_kept(self, failure: Exception) -> None:
        """The group's loop failed on a later member (a message that cannot be encoded): the jobs kept before
        it go out, as plain Celery's loop had sent them; one the store or broker refuses too is logged with
        the loop's failure, which the caller raises."""
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - logged; the loop's own failure is the one raised
            log.error("a group failed (%s); its jobs kept before the failure were not sent either: %s",
                      failure, exc, extra={"action": "group_partly_unsent"})

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
        try:
            created.update(id(item) for item in _record(items))
        except StoreUnavailable:
            # The batch may have committed unanswered: a body told so forgets its jobs when it ends, as it
            # does a single publish's.
            for item in kept:
                if item.parent is not None:
                    item.parent.unsent.append(item.job.id)
            raise
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
                item.store.publishes.forget_unpublished(item.job.id)
        raise


def _record(items: list[_Kept]) -> list[_Kept]:
    """Record ``items`` of one store as one batch, or one by one when an id is known already (a frozen group
    applied again); the items whose rows this made."""
    store = items[0].store
    try:
        store.publishes.record_batch([item.job for item in items])
        return items
    except StoreConflict:
        pass
    created = []
    for item in items:
        job = item.job
        new, _ = store.publishes.record(job.id, job.task_name, job.queue, job.payload, job.max_attempts, None,
                                        job.delay, recovery=job.recovery, reopen=item.reopen)
        if new:
            created.append(item)
    return created


def current() -> Batch | None:
    return _current.get()


_install_lock = threading.Lock()
_refused = False  # whether install() found a group it does not know (logged once)


def install() -> bool:
    """Wrap ``celery.canvas.group._apply_tasks`` once per process, if its shape is the one known; whether
    groups are batched."""
    global _refused
    with _install_lock:
        original: Any = getattr(group, "_apply_tasks", None)
        if getattr(original, "_celery_lease_batched", False):
            return True
        unknown = _unknown_shape(original)
        if unknown is not None:
            if not _refused:
                _refused = True
                log.warning("Celery %s: %s; the LeaseTask jobs of a group are published one by one",
                            celery.__version__, unknown, extra={"action": "group_batching_off"})
            return False
        group._apply_tasks = _batched(original)
        return True


def _unknown_shape(apply_tasks: Any) -> str | None:
    """What of ``group._apply_tasks`` differs from what the wrapper knows (None: nothing)."""
    if apply_tasks is None:
        return "celery.canvas.group has no _apply_tasks"
    if not inspect.isgeneratorfunction(apply_tasks):
        return "group._apply_tasks is not a generator function"
    try:
        parameters = list(inspect.signature(apply_tasks).parameters.values())
    except (TypeError, ValueError):
        return "group._apply_tasks has no signature to read"
    head = tuple(p.name for p in parameters[:len(_KNOWN_HEAD)]
                 if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if head != _KNOWN_HEAD:
        return (f"group._apply_tasks{inspect.signature(apply_tasks)} does not begin with the "
                f"parameters ({', '.join(_KNOWN_HEAD)})")
    return None


def _batched(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """``original`` with a batch opened for its loop once the loop reaches a leased signature."""

    @functools.wraps(original)
    def _apply_tasks(self: Any, tasks: Iterable[Any], producer: Any = None, app: Any = None,
                     *args: Any, **kwargs: Any) -> Iterator[Any]:
        # A group inside a group's loop joins its batch. A producer the caller passed is where Celery sends
        # every member: a batch would send through the app's own.
        if _current.get() is not None or producer is not None:
            yield from original(self, tasks, producer, app, *args, **kwargs)
            return
        loop = _Loop(app or self.app)
        # Consumed here, so the batch's context is not shared with the caller between items.
        try:
            results = list(original(self, loop.watch(tasks), producer, app, *args, **kwargs))
        except Exception as exc:
            if loop.batch is not None:
                loop.batch.send_kept(exc)
            raise
        except BaseException:
            if loop.batch is not None:
                loop.batch.discard()
            raise
        finally:
            loop.leave()
        if loop.batch is not None:
            loop.batch.close()
        yield from results

    _apply_tasks._celery_lease_batched = True  # type: ignore[attr-defined]
    return _apply_tasks


class _Loop:
    """One group's loop: the batch it opened when it reached the first leased signature, if any."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.batch: Batch | None = None
        self._token: Token[Any] | None = None

    def watch(self, tasks: Iterable[Any]) -> Iterator[Any]:
        """``tasks`` as Celery's loop reads them (one ahead, in the wrapper's context), opening the batch
        before a leased one is sent."""
        for item in tasks:
            if self.batch is None and _sends_leased(item[0] if isinstance(item, tuple) else item, self.app):
                self.batch = Batch()
                self._token = _current.set(self.batch)
            yield item

    def leave(self) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None


def _sends_leased(sig: Any, app: Any) -> bool:
    """Whether applying ``sig`` may publish a leased job; what cannot be read without running a generator
    counts as leased (a batch costs an unleased group nothing)."""
    if not isinstance(sig, Signature):
        if not isinstance(sig, dict):
            return True
        sig = maybe_signature(sig, app=app)
    parts = [part for part in (getattr(sig, "tasks", None), getattr(sig, "body", None)) if part is not None]
    if parts:
        for part in parts:
            if isinstance(part, (Signature, dict)):
                part = [part]
            elif type(part) not in (list, tuple):
                return True  # a group of a generator: read by Celery alone, as it sends
            if any(_sends_leased(inner, app) for inner in part):
                return True
        return False
    try:
        task = sig.type
    except Exception:  # noqa: BLE001 - any other error, Celery meets again when it applies it
        return False  # a name not registered goes out by send_task, not through a LeaseTask
    return leased(task)
