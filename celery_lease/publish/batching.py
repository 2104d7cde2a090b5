"""A group's LeaseTask jobs recorded a batch at a time, before their messages are sent.

Celery's ``group`` (and so a chord's header) sends each signature through its task's own
``apply_async``, one after another, inside ``group._apply_tasks``: the one place that sees the
whole group. install() wraps it, once per process, when a LeaseTask is bound to an app (never at
import). The wrapper opens a batch for a group's loop once the loop reaches a signature that may
send a leased job (a LeaseTask, or a chain, chord or group holding one); a group of plain tasks
goes through Celery's own loop with no batch. Inside a batch, the publish of a new
LeaseTask job without an idempotency key keeps its encoded message instead of recording and
sending it. The kept jobs are recorded with one INSERT per table per RECORD_BATCH jobs
(store.publishes.record_batch), then their messages are sent in the group's order: when the loop ends,
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

The wrapper knows ``_apply_tasks`` as Celery 5.3 to 5.7 define it: a generator function whose
first parameters are ``(self, tasks, producer, app)``, ``tasks`` yielding ``(signature, result,
group id)``. With a Celery whose ``group`` differs, install() leaves it alone and logs one
WARNING: groups then publish job by job, each as a single publish (correct, one INSERT a job).
"""

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
from ..errors import StoreConflict
from ..kinds import leased
from ..store import NewJob, Store

__all__ = ["Batch", "current", "install"]

log = logging.getLogger(__name__)

# Seconds a kept job waits at most for the rest of its batch.
BATCH_WAIT = 0.05

# The parameters of ``group._apply_tasks`` the wrapper passes on by position, first in its
# signature on Celery 5.3 to 5.5 (then ``p, add_to_parent, chord, args, kwargs, **options``)
# and 5.6 to 5.7 (``group_index`` before ``**options``).
_KNOWN_HEAD = ("self", "tasks", "producer", "app")


@dataclasses.dataclass
class _Kept:
    """One job of the batch: its record, whether publishing its id may reopen a finished job, and
    the send of its message (given a producer of its app)."""

    app: Any
    store: Store
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

    def keep(self, app: Any, store: Store, job: NewJob, reopen: bool,
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
                item.store.publishes.forget_unpublished(item.job.id)
        raise


def _record(items: list[_Kept]) -> list[_Kept]:
    """Record ``items`` of one store, as one batch or, when an id is known already, one by one;
    the items whose rows this made (a known id keeps its row and, as a single publish of it
    would, still gets its message)."""
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
    """The batch of the group being published in this context, if any."""
    return _current.get()


_install_lock = threading.Lock()
_refused = False  # whether install() found a group it does not know (logged once)


def install() -> bool:
    """Wrap ``celery.canvas.group._apply_tasks`` once per process, if its shape is the one known.

    Called whenever a LeaseTask is bound to an app (idempotent). Returns whether groups are batched.
    """
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
        if _current.get() is not None:  # a group inside a group's loop joins its batch
            yield from original(self, tasks, producer, app, *args, **kwargs)
            return
        loop = _Loop(app or self.app)
        # group.apply_async takes the whole list at once: consuming it here keeps the batch's
        # context to the loop (a generator's frame would share it with the caller between items).
        try:
            results = list(original(self, loop.watch(tasks), producer, app, *args, **kwargs))
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
        """``tasks`` as Celery's loop reads them, opening the batch before a leased one is sent.

        The loop reads one item ahead of the one it sends, and reads it in the context of the
        wrapper (a generator has no context of its own), so the batch is current from there on.
        """
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
    """Whether applying ``sig`` may publish a leased job: a leased task's signature, or a chain,
    chord or group holding one. What cannot be read without running a generator counts as leased
    (a batch costs nothing to a group that keeps no job)."""
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
