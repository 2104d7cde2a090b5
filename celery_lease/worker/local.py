"""``self.lease`` outside a worker (eager runs, ``apply()``, direct calls): a local handle with the Lease
surface whose effect keys and locks live on the app, bounded, so a test sees what a run did
(``celery_lease.testing``)."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from ..app_state import app_state
from ..context import LOCAL as _current
from ..vocabulary import EffectOutcome

__all__ = ["LocalLease", "LocalState", "state", "current", "running"]

LOCAL_KEPT = 1000  # effect keys, and checkpoints, the local runs of one app keep (the newest)


@dataclasses.dataclass
class _SharedLock:
    """An in-process lock on one resource and how many runs hold it or wait for it."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    users: int = 0


@dataclasses.dataclass
class LocalState:
    """The effect keys and resource locks of the local runs of one app, in this process; bounded (the newest
    ``LOCAL_KEPT`` keys and checkpoints) so a long-lived process does not grow without end."""

    effects: OrderedDict[str, str] = dataclasses.field(default_factory=OrderedDict)
    checkpoints: OrderedDict[str, Any] = dataclasses.field(default_factory=OrderedDict)
    _locks: dict[str, _SharedLock] = dataclasses.field(default_factory=dict)
    _mutex: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def claim_effect(self, key: str, job_id: str) -> bool:
        with self._mutex:
            if key in self.effects:
                return False
            self.effects[key] = job_id
            _trim(self.effects)
            return True

    def forget_effect(self, key: str) -> None:
        with self._mutex:
            self.effects.pop(key, None)

    def keep_checkpoint(self, job_id: str, state: Any) -> None:
        with self._mutex:
            self.checkpoints[job_id] = state
            self.checkpoints.move_to_end(job_id)
            _trim(self.checkpoints)

    @contextlib.contextmanager
    def holding(self, resource: str, timeout: float) -> Iterator[bool]:
        """Hold ``resource``'s in-process lock, waiting up to ``timeout``; yields whether it was taken."""
        with self._mutex:
            shared = self._locks.setdefault(resource, _SharedLock())
            shared.users += 1
        try:
            taken = shared.lock.acquire(timeout=timeout)
            try:
                yield taken
            finally:
                if taken:
                    shared.lock.release()
        finally:
            with self._mutex:
                shared.users -= 1
                if not shared.users and self._locks.get(resource) is shared:
                    del self._locks[resource]

    def clear(self) -> None:
        with self._mutex:
            self.effects.clear()
            self.checkpoints.clear()
            self._locks.clear()


def _trim(kept: OrderedDict[str, Any]) -> None:
    while len(kept) > LOCAL_KEPT:
        kept.popitem(last=False)


def state(app: Any) -> LocalState:
    holder = app_state(app)
    found: LocalState | None = holder.local
    if found is None:
        found = holder.local = LocalState()
    return found


class LocalLease:
    """The handle of a run outside a worker: the Lease surface, kept in this process."""

    lost = False
    lost_reason: str | None = None

    def __init__(self, app: Any, job_id: str, idempotency_key: str) -> None:
        self.app, self.state = app, state(app)
        self.job_id = job_id
        self.token = secrets.token_hex(16)
        self.attempt = 1
        self.idempotency_key = idempotency_key
        self.checkpoint_state = self.state.checkpoints.get(job_id)

    def __repr__(self) -> str:
        return f"<LocalLease job={self.job_id}>"

    def check(self) -> None:
        """A local run never loses its lease."""

    def extend(self, seconds: float) -> None:
        """Nothing to renew outside a worker."""

    def checkpoint(self, state: Any) -> None:
        """Keep the progress for a later run of the same job id in this process."""
        self.checkpoint_state = state
        self.state.keep_checkpoint(self.job_id, state)

    @contextlib.contextmanager
    def effect(self, key: str, connection: Any = None, using: str | None = None) -> Iterator[bool]:
        """First once per key in this process; a block that raises gives its key back. With a connection (or a
        Django ``using`` alias) the key is written in that transaction, as a worker writes it."""
        if connection is not None or using is not None:
            with self._effect_in(key, connection, using) as first:
                yield first
            return
        first = self.state.claim_effect(key, self.job_id)
        try:
            yield first
        except BaseException:
            if first:
                self.state.forget_effect(key)
            raise

    @contextlib.contextmanager
    def _effect_in(self, key: str, connection: Any, using: str | None) -> Iterator[bool]:
        from ..errors import StoreUnavailable
        from ..store import for_app
        from .effects import connection_for, refuse_autocommit

        connection = connection_for(using) if using is not None else connection
        refuse_autocommit(connection, key)
        store = for_app(self.app, check=False)
        first = store.effects.record_unfenced_effect_in(connection, key, self.job_id) == EffectOutcome.FIRST
        try:
            yield first
        except BaseException:
            if first:
                # An aborted transaction can only roll back, and the rollback drops the key.
                with contextlib.suppress(StoreUnavailable):
                    store.effects.unrecord_effect_in(connection, key, self.job_id)
            raise

    @contextlib.contextmanager
    def lock(self, resource: str, ttl: float | None = None, timeout: float | None = None) -> Iterator[None]:
        """An in-process lock on ``resource``; LockUnavailable after ``timeout`` seconds."""
        from ..config import BY_NAME
        from ..errors import LockUnavailable

        wait = BY_NAME["lease_lock_timeout"].default if timeout is None else float(timeout)
        with self.state.holding(resource, wait) as taken:
            if not taken:
                raise LockUnavailable(resource, wait)
            yield


def current() -> LocalLease | None:
    return _current.get()


@contextlib.contextmanager
def running(app: Any, job_id: str | None, name: str) -> Iterator[LocalLease]:
    """Make a local handle the current one while a body runs outside a worker."""
    job_id = job_id or secrets.token_hex(16)
    lease = LocalLease(app, job_id, f"{name}:{job_id}")
    token = _current.set(lease)
    try:
        yield lease
    finally:
        _current.reset(token)
