"""A runtime's two helper threads: the deadline timer, which marks leases and locks lost at their local
deadlines however long a store call takes, and the kept cancels."""

from __future__ import annotations

import collections
import logging
import threading
from typing import TYPE_CHECKING, Any

import celery_lease.deadline as deadline

from ..errors import StoreRejected, StoreUnavailable
from .handles import RuntimeHandle
from .loop import Loop

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["DeadlineTimer", "PendingCancels", "MAX_TIMER_SLEEP", "CANCELS_KEPT"]

log = logging.getLogger(__name__)

MAX_TIMER_SLEEP = 5.0  # seconds the timer sleeps with no deadline in sight
CANCELS_KEPT = 10_000  # cancels the store did not take that a process remembers (the newest)


class DeadlineTimer:
    """Marks leases and resource locks lost at their local deadlines; ``run_once(now)`` is one pass."""

    def __init__(self, runtime: RuntimeHandle) -> None:
        self.runtime = runtime
        self._loop = Loop("celery-lease-deadline", self._pass, self._pass_failed)
        # When the loop next looks (monotonic); None while a pass is reading the leases.
        self._planned: float | None = None

    def run_once(self, now: float | None = None) -> float | None:
        """Expire every lease and lock past its deadline; returns the next deadline, if any."""
        now = deadline.monotonic() if now is None else now
        upcoming = [lease.deadline for lease in self.runtime.leases() if not lease.expire_if_due(now)]
        lock_due = self.runtime.locks.expire_due(now)
        if lock_due is not None:
            upcoming.append(lock_due)
        return min(upcoming, default=None)

    def watch(self, due: float) -> None:
        """A lease due at ``due`` joined: wake the loop only if it would look later (a wake costs the claiming
        thread a GIL hand-off)."""
        planned = self._planned
        if planned is None or due < planned:
            self._loop.wake()

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._loop.stop(timeout)

    def _pass(self) -> float:
        # Cleared before the pass reads the leases: a lease added meanwhile sees None and wakes us.
        self._planned = None
        return self._plan(self.run_once())

    def _pass_failed(self) -> float:
        log.exception("deadline timer of %s failed", self.runtime.worker)
        return self._plan(None)

    def _plan(self, upcoming: float | None) -> float:
        """Sleep to the next deadline exactly; a new lease or a stop wakes the loop earlier."""
        now = deadline.monotonic()
        pause = MAX_TIMER_SLEEP if upcoming is None else min(max(0.0, upcoming - now), MAX_TIMER_SLEEP)
        self._planned = now + pause
        return pause


class PendingCancels:
    """Cancels the store did not take because it was unreachable, written once it answers. Celery acks a
    revoked delivery whatever the store said: a lost cancel would leave the job pending for the dispatch
    scan to run."""

    def __init__(self, store: Store, interval: float) -> None:
        self.store = store
        self.interval = interval
        self._mutex = threading.Lock()
        # job id -> store.jobs.cancel's keywords for it
        self._kept: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._loop = Loop("celery-lease-cancels", self._retry, self._retry_failed)

    def __len__(self) -> int:
        with self._mutex:
            return len(self._kept)

    def cancel(self, job_id: str, reason: str, owner: str | None = None, task_name: str | None = None,
               queue: str | None = None) -> bool:
        """Cancel ``job_id`` now, or keep it for when the store answers; True when written now. While cancels
        are kept a new one joins them without a call, so an outage costs a revoke one call bound."""
        order: dict[str, Any] = {"reason": reason, "owner": owner, "task_name": task_name, "queue": queue}
        self.flush()
        if len(self):
            self._keep(job_id, order)
            return False
        try:
            self.store.jobs.cancel(job_id, **order)
        except StoreRejected as exc:
            log.error("job %s: the store rejected its cancel (%s); not retried", job_id, exc)
            return False
        except StoreUnavailable as exc:
            self._keep(job_id, order)
            log.warning("job %s: lease store unreachable (%s); its cancel (%s) is kept and written when the "
                        "store answers", job_id, exc, reason, extra={"action": "cancel_deferred"})
            return False
        return True

    def _keep(self, job_id: str, order: dict[str, Any]) -> None:
        with self._mutex:
            self._kept[job_id] = order
            self._kept.move_to_end(job_id)
            while len(self._kept) > CANCELS_KEPT:
                dropped, _ = self._kept.popitem(last=False)
                log.error("job %s: too many cancels kept while the store is down; dropped", dropped)
            self._loop.start(delay=self.interval)

    def flush(self) -> int:
        """Write the kept cancels, oldest first; stops at the first that finds the store down."""
        with self._mutex:
            kept = list(self._kept.items())
        written = 0
        for job_id, order in kept:
            try:
                self.store.jobs.cancel(job_id, **order)
            except StoreRejected as exc:
                log.error("job %s: the store rejected its kept cancel (%s); dropped", job_id, exc)
            except StoreUnavailable:
                return written
            else:
                written += 1
                log.info("job %s: kept cancel (%s) written after the store came back", job_id,
                         order["reason"], extra={"action": "cancel_written"})
            with self._mutex:
                if self._kept.get(job_id) == order:
                    del self._kept[job_id]
        return written

    def _retry(self) -> float:
        self.flush()
        return self._again()

    def _retry_failed(self) -> float:
        log.exception("kept cancels: flush failed")
        return self._again()

    def _again(self) -> float:
        """Try again in ``interval`` seconds while a cancel is kept; else end the loop."""
        with self._mutex:
            if not self._kept:
                # Under the mutex: a cancel kept from now on starts a new loop.
                self._loop.stop()
            return self.interval
