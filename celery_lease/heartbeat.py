"""One renewal thread per worker process.

Every interval the thread renews all leases this process holds in one statement,
refreshes the process's row in the worker registry, and marks lost the leases
that the statement did not renew. A job past ``lease_max_runtime`` is no longer
renewed, so a hung body cannot hold its lease forever.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import LeaseError, StoreUnavailable
from .vocabulary import Event

if TYPE_CHECKING:
    from .store import Store
    from .task import Lease

__all__ = ["Heartbeat", "for_process", "worker_id"]

log = logging.getLogger(__name__)

# The clock seam tests may replace; intervals are local, so monotonic.
monotonic: Callable[[], float] = time.monotonic


def worker_id(hostname: str | None = None, pid: int | None = None) -> str:
    """The id of one worker process: its Celery node name and pid."""
    return f"{hostname or socket.gethostname()}:{pid or os.getpid()}"


def raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> bool:
    """Raise ``exc_type`` asynchronously in a thread (None clears a pending one)."""
    count = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None
    )
    return count == 1


class Heartbeat:
    """Renews this process's leases; ``beat()`` is one round, ``start()`` the loop."""

    def __init__(self, store: Store, worker: str, hostname: str, default_interval: float) -> None:
        self.store = store
        self.worker = worker
        self.hostname = hostname
        self.default_interval = default_interval
        self.leases: dict[str, Lease] = {}
        self.renewers: list[Callable[[], None]] = []
        self.beats = 0
        self._extend: dict[str, float] = {}
        self._deferred: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._planned_interval = default_interval
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()

    # -- membership ------------------------------------------------------
    def add(self, lease: Lease) -> None:
        with self._lock:
            self.leases[lease.token] = lease
            # Wake the thread only when this lease needs beats sooner than it planned.
            sooner = lease.policy.heartbeat_interval < self._planned_interval
        self.start()
        if sooner:
            self._wake.set()

    def remove(self, lease: Lease) -> None:
        with self._lock:
            if lease.token not in self._deferred:
                self.leases.pop(lease.token, None)
            self._extend.pop(lease.token, None)

    def defer_completion(self, lease: Lease) -> None:
        """Keep a finished job's lease and complete it once the store answers again."""
        with self._lock:
            self._deferred[lease.token] = lease
            self.leases[lease.token] = lease

    @property
    def interval(self) -> float:
        with self._lock:
            intervals = [lease.policy.heartbeat_interval for lease in self.leases.values()]
        return min([self.default_interval, *intervals])

    # -- one round ---------------------------------------------------------
    def beat(self) -> dict[str, int]:
        """Renew every held lease once; returns counts (held, renewed, lost, expired_runtime)."""
        now = monotonic()
        with self._lock:
            held = dict(self.leases)
            extend = dict(self._extend)
            self._extend.clear()
        renewable = {tok: lease for tok, lease in held.items() if not lease.past_max_runtime(now)}
        counts = {"held": len(held), "renewed": 0, "lost": 0, "past_max_runtime": len(held) - len(renewable)}
        try:
            renewed = self.store.beat(self.worker, self.hostname, os.getpid(),
                                      {t: lease.job_id for t, lease in renewable.items()}, extend)
        except StoreUnavailable as exc:
            log.warning("heartbeat of %s could not reach the lease store: %s", self.worker, exc,
                        extra={"action": "heartbeat_store_unavailable"})
            for lease in renewable.values():
                if now - lease.renewed_at > lease.policy.duration:
                    lease.mark_lost("store unreachable for longer than the lease")
                    counts["lost"] += 1
            return counts
        self.beats += 1
        for token, lease in renewable.items():
            if lease.job_id in renewed:
                lease.renewed_at = now
                counts["renewed"] += 1
            elif lease.finishing and token not in self._deferred:
                # The body is over and its final write already cleared the token:
                # not a loss, just a lease that ended between snapshot and renewal.
                continue
            else:
                reason, owner = self.store.describe_loss(lease.job_id, token, self.worker)
                lease.mark_lost(reason, owner)
                counts["lost"] += 1
                with self._lock:
                    self.leases.pop(token, None)
                    self._deferred.pop(token, None)
        self._flush_deferred()
        for renewer in list(self.renewers):
            try:
                renewer()
            except LeaseError as exc:
                log.warning("heartbeat renewer failed: %s", exc)
        return counts

    def _flush_deferred(self) -> None:
        with self._lock:
            deferred = list(self._deferred.values())
        for lease in deferred:
            try:
                lease.store.complete(lease.job_id, lease.token, self.worker)
            except StoreUnavailable:
                return
            log.info("job %s [%s] completed after the store came back", lease.job_id, lease.token[:8])
            with self._lock:
                self._deferred.pop(lease.token, None)
                self.leases.pop(lease.token, None)

    def extend(self, lease: Lease, seconds: float) -> bool:
        """Renew one lease now with a new duration; False when it is no longer ours."""
        renewed = self.store.renew({lease.token: lease.job_id}, self.worker, {lease.token: seconds})
        if lease.job_id in renewed:
            lease.renewed_at = monotonic()
            return True
        reason, owner = self.store.describe_loss(lease.job_id, lease.token, self.worker)
        lease.mark_lost(reason, owner)
        return False

    def release_all(self, reason: Event = Event.RELEASED_ON_SHUTDOWN) -> int:
        """Give back every lease still held (shutdown); returns how many were released."""
        with self._lock:
            held = [lease for tok, lease in self.leases.items() if tok not in self._deferred]
        released = 0
        for lease in held:
            try:
                if lease.give_back(reason):
                    released += 1
                    lease.mark_lost(reason)
            except StoreUnavailable as exc:
                log.warning("could not release job %s on shutdown: %s", lease.job_id, exc)
        self._flush_deferred()
        return released

    # -- the loop -------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="celery-lease-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        last_beat = float("-inf")
        while not self._stop.is_set():
            self._planned_interval = self.interval
            self._wake.wait(max(0.0, last_beat + self._planned_interval - monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                break
            if monotonic() < last_beat + self.interval:
                continue  # woken for a shorter interval: plan again
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the thread must outlive any one bad round
                log.exception("heartbeat round of %s failed", self.worker)
            last_beat = monotonic()


_process: dict[str, Any] = {}
_process_lock = threading.Lock()


def for_process(app: Any, store: Store, hostname: str | None = None) -> Heartbeat:
    """This process's heartbeat for an app (a forked child gets its own)."""
    key = f"{id(app)}:{os.getpid()}"
    hb = _process.get(key)
    if hb is None:
        with _process_lock:
            hb = _process.get(key)
            if hb is None:
                from .config import app_config

                host = hostname or socket.gethostname()
                hb = Heartbeat(store, worker_id(host), host, app_config(app).heartbeat_interval)
                _process[key] = hb
    return hb


def current(app: Any) -> Heartbeat | None:
    """This process's heartbeat for an app, if one was started."""
    return _process.get(f"{id(app)}:{os.getpid()}")
