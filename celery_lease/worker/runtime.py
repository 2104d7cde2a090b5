"""One runtime per worker process: the leases of its running bodies (by request, and by job id and token so a
stale and a new claim of one job never share a lease), its heartbeat, deadline timer and locks."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import weakref
from typing import TYPE_CHECKING, Any

import celery_lease.deadline as deadline
import celery_lease.messaging.messages as messages
import celery_lease.store as stores
import celery_lease.worker.at_exit as at_exit
import celery_lease.worker.deliveries as deliveries
import celery_lease.worker.interrupt as interrupt

from ..app_state import app_state
from ..config import TaskPolicy, app_config, task_policy
from ..errors import StoreRejected, StoreUnavailable
from ..vocabulary import Event
from .handles import DeferredWrite
from .lease import Lease
from .locks import Locks
from .threads import MAX_TIMER_SLEEP, WRITES_KEPT, DeadlineTimer, Heartbeat, PendingWrites, worker_id

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..store import Job, Store
    from .pause import ConsumerPause

__all__ = ["Runtime", "DeadlineTimer", "PendingWrites", "MAX_TIMER_SLEEP", "WRITES_KEPT", "Process",
           "PROCESS", "for_app", "for_delivery", "current", "retire", "in_process", "release_all_in_process"]

log = logging.getLogger(__name__)


class Runtime:
    """This process's leases and the threads that keep them honest."""

    def __init__(self, store: Store, hostname: str, default_interval: float, *,
                 worker: str | None = None, interrupter: type[interrupt.Interrupter] | None = None) -> None:
        self.store = store
        self.hostname = hostname
        self.worker = worker or worker_id(hostname)
        self.default_interval = default_interval
        self.interrupter = interrupter or interrupt.for_process()
        self.pid = os.getpid()
        self._mutex = threading.Lock()
        self._drained = threading.Condition(self._mutex)  # notified as deferred writes land or are dropped
        self._by_request: dict[int, Lease] = {}
        self._held: dict[tuple[str, str], Lease] = {}
        self._deferred: dict[tuple[str, str], Lease] = {}
        self._to_give_back: dict[tuple[str, str], Lease] = {}
        self.locks: Locks = Locks(store)
        self.heartbeat = Heartbeat(self)
        self.timer = DeadlineTimer(self)
        self._starting = threading.Lock()  # concurrent first tasks (a threads pool) start once
        self._flushing = threading.Lock()
        self.pause: ConsumerPause | None = None  # stops the main process's consumer in an outage (outage.py)
        self.unanswered = deliveries.UnansweredClaims()  # claims given up unanswered: one may have committed
        # for_delivery's store (None: looked up per delivery), policy and terms by (task, queue, nesting).
        self.deliveries: dict[tuple[str, str | None, int],
                              tuple[Store | None, TaskPolicy, stores.ClaimTerms]] = {}

    def admit(self, task: Any, request: Any, job: Job, token: str, policy: TaskPolicy, *, sent_at: float,
              record_again: Callable[[], bool], soft: interrupt.SoftLimit | None = None) -> Lease:
        """The claim succeeded, so the delivery's store retries are forgotten: attach its new lease."""
        messages.forget_store_retries(request)
        # A per-call time_limit is the one this run is killed at: a default lease_max_runtime follows it.
        hard = (getattr(request, "timelimit", None) or (None,))[0]
        if hard and policy.max_runtime == (task.time_limit or task.app.conf.task_time_limit):
            policy = dataclasses.replace(policy, max_runtime=float(hard))
        lease = Lease(self, job.id, token, job.attempt_count, policy,
                      job.idempotency_key or f"{task.name}:{job.id}", job.checkpoint_state(), sent_at=sent_at,
                      app=task.app, acks_late=bool(task.acks_late), record_again=record_again,
                      soft_limit=soft)
        try:
            self.attach(request, lease)
        except BaseException:
            self.detach(request, lease)
            raise
        return lease

    def attach(self, request: Any, lease: Lease) -> None:
        """A body is about to run under ``lease``: renew it and watch its deadline."""
        with self._mutex:
            self._by_request[id(request)] = lease
            self._held[(lease.job_id, lease.token)] = lease
        self.start()
        self.heartbeat.joined(lease)
        self.timer.watch(lease.deadline)

    def detach(self, request: Any, lease: Lease) -> None:
        """The body is over; a deferred completion or a pending give-back keeps the lease listed."""
        key = (lease.job_id, lease.token)
        self.unbind(request, lease)
        with self._mutex:
            if key not in self._deferred:
                self._held.pop(key, None)

    def bind(self, request: Any, lease: Lease) -> None:
        with self._mutex:
            self._by_request[id(request)] = lease

    def unbind(self, request: Any, lease: Lease) -> None:
        with self._mutex:
            if self._by_request.get(id(request)) is lease:
                del self._by_request[id(request)]

    def lease_for(self, request: Any) -> Lease | None:
        """The lease of the body running for this request (a request context object)."""
        return self._by_request.get(id(request))

    def leases(self) -> list[Lease]:
        """Every lease this process holds or still has to complete."""
        with self._mutex:
            return list(self._held.values())

    def is_deferred(self, lease: Lease) -> bool:
        return (lease.job_id, lease.token) in self._deferred

    def forget(self, lease: Lease) -> None:
        """The store says the lease is gone: stop renewing, completing and giving it back."""
        key = (lease.job_id, lease.token)
        with self._mutex:
            self._held.pop(key, None)
            self._deferred.pop(key, None)
            self._to_give_back.pop(key, None)
            self._drained.notify_all()

    def lost_locally(self, lease: Lease, give_back: bool) -> None:
        """The lease passed its local deadline: stop renewing it (and give it back when told)."""
        key = (lease.job_id, lease.token)
        with self._mutex:
            if key not in self._deferred:
                self._held.pop(key, None)
            if give_back and key not in self._deferred:
                self._to_give_back[key] = lease

    def defer(self, lease: Lease, write: DeferredWrite) -> None:
        """Keep a finished body's lease renewed and make its settle write once the store answers."""
        key = (lease.job_id, lease.token)
        with self._mutex:
            lease.deferred = write
            self._deferred[key] = lease
            self._held[key] = lease
            # A give-back queued by a loss (a lock taken, a deadline) would run the finished body again.
            self._to_give_back.pop(key, None)

    def extend(self, lease: Lease, seconds: float) -> bool:
        """Renew one lease now with a new duration, trusting the shorter meanwhile; False once not ours."""
        def attempt() -> bool | None:
            # Not beside a heartbeat round (Heartbeat.renewing says why); None: the row is not ours.
            with self.heartbeat.renewing:
                sent = deadline.monotonic()
                lease.extending(sent, seconds)
                self.timer.watch(lease.deadline)  # a shorter lease's deadline came closer
                held = {lease.token: lease.job_id}
                renewed = self.store.jobs.renew(held, self.worker, {lease.token: seconds})
                return lease.confirm(sent, seconds) if lease.job_id in renewed else None

        confirmed = lease.patiently(attempt)
        if confirmed:
            # Renewed for ``seconds`` at each heartbeat from now on: a short one needs them sooner.
            self.heartbeat.joined(lease)
            self.timer.watch(lease.deadline)
            return True
        if confirmed is None:
            reason, owner = self.store.jobs.describe_loss(lease.job_id, lease.token, self.worker)
            lease.mark_lost(reason, owner)
            self.forget(lease)
        return False

    @property
    def interval(self) -> float:
        return min([self.default_interval, *(lease.renew_every for lease in self.leases())])

    def give_back_lost(self) -> int:
        """Release, fenced on their tokens, the leases lost locally; returns how many were released."""
        with self._mutex:
            pending = list(self._to_give_back.values())
        released = 0
        for lease in pending:
            try:
                # Re-send the message: the body stopped (LeaseLost) and its delivery is acked.
                done = lease.give_back(Event.RELEASED_AFTER_LOCAL_LOSS, republish=True)
            except StoreUnavailable:
                return released
            except StoreRejected as exc:
                # Refused for good: asking again every round cannot help; the reaper recovers it.
                log.error("job %s [%s] could not be given back, the store refused it (%s); left to "
                          "the reaper", lease.job_id, lease.token[:8], exc,
                          extra={"action": "give_back_rejected"})
                with self._mutex:
                    self._to_give_back.pop((lease.job_id, lease.token), None)
                continue
            released += done
            with self._mutex:
                self._to_give_back.pop((lease.job_id, lease.token), None)
            log.info("job %s [%s] %s after its local deadline passed", lease.job_id, lease.token[:8],
                     "given back" if done else "had already moved on",
                     extra={"action": Event.RELEASED_AFTER_LOCAL_LOSS})
        return released

    def wait_drained(self, timeout: float) -> None:
        """Wait until no settle write is deferred, or ``timeout`` seconds."""
        with self._drained:
            self._drained.wait_for(lambda: not self._deferred, timeout)

    def flush_deferred(self) -> None:
        """Make the settle writes the store could not take, and act on its real answer to each; one thread at
        a time (the heartbeat's and an exit's would both make a write and its follow-up)."""
        if self._flushing.acquire(blocking=False):
            try:
                self._flush_deferred()
            finally:
                self._flushing.release()

    def _flush_deferred(self) -> None:
        with self._mutex:
            deferred = [(lease, lease.deferred) for lease in self._deferred.values() if lease.deferred]
        for lease, write in deferred:
            try:
                written = (write.landed is not None and write.landed()) or write.write()
                if not written and lease.vanished_and_recorded_again():
                    written = write.write()  # the row vanished while the store was away (a restore)
            except StoreRejected as exc:
                # Retrying would loop for ever: the lease expires and the reaper decides.
                log.error("job %s [%s]: deferred %s rejected by the store for good (%s)", lease.job_id,
                          lease.token[:8], write.end, exc, extra={"action": "deferred_write_rejected"})
                self.forget(lease)
                continue
            except StoreUnavailable:
                return
            self.forget(lease)
            if not written:
                # The first try may have committed unanswered: a job left pending gets its message again.
                log.warning("job %s [%s]: deferred %s rejected, the lease moved on", lease.job_id,
                            lease.token[:8], write.end, extra={"action": "stale_deferred_write_rejected"})
                lease.send_if_pending()
                continue
            log.info("job %s [%s]: %s written after the store came back", lease.job_id, lease.token[:8],
                     write.end, extra={"action": "deferred_write_landed"})
            if write.then is not None:
                try:
                    write.then()
                except Exception as exc:  # noqa: BLE001 - logged; the write itself landed
                    log.error("job %s [%s]: what follows the deferred %s failed (%s)", lease.job_id,
                              lease.token[:8], write.end, exc, extra={"action": "deferred_followup_failed"})

    def flush_checkpoints(self) -> None:
        """Write the checkpoints of running bodies that an outage held back."""
        for lease in self.leases():
            if lease.pending_checkpoint is None:
                continue
            try:
                lease.write_pending_checkpoint()
            except StoreRejected as exc:  # write_pending_checkpoint dropped it
                log.error("job %s [%s]: held-back checkpoint rejected by the store (%s); dropped",
                          lease.job_id, lease.token[:8], exc, extra={"action": "checkpoint_rejected"})
            except StoreUnavailable:
                return

    def release_all(self, reason: Event = Event.RELEASED_ON_SHUTDOWN) -> int:
        """Give back every lease still held (shutdown); returns how many were released."""
        with self._mutex:
            held = [lease for key, lease in self._held.items() if key not in self._deferred]
        released = 0
        for lease in held:
            try:
                if lease.give_back(reason):
                    released += 1
                    lease.mark_lost(reason)
            except (StoreUnavailable, StoreRejected) as exc:
                log.warning("could not release job %s [%s] on shutdown: %s", lease.job_id,
                            lease.token[:8], exc)
        released += self.give_back_lost()  # lost locally, not yet given back: no heartbeat round comes now
        at_exit.settle_before_exit(self)
        kept: PendingWrites | None = self.__dict__.get("_kept_writes")
        if kept is not None and len(kept):
            kept.flush()
            if len(kept):
                log.error("%d write(s) kept while the store was down are lost with this process: %s",
                          len(kept), self.worker, extra={"action": "kept_writes_lost"})
        return released

    @property
    def kept_writes(self) -> PendingWrites:
        """This process's writes kept for when the store answers (PendingWrites), made on first use."""
        with self._mutex:
            kept: PendingWrites | None = self.__dict__.get("_kept_writes")
            if kept is None:
                kept = self.__dict__["_kept_writes"] = PendingWrites(self.store, self.default_interval)
            return kept

    def start(self) -> None:
        """Start the heartbeat and the deadline timer once, however many first tasks call it at once."""
        with self._starting:
            self.heartbeat.start()
            self.timer.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.timer.stop(timeout)
        self.heartbeat.stop(timeout)


class Process:
    """A runtime per app, and the worker (app, node name) starting here, which its forked children join."""

    def __init__(self) -> None:
        # By (id(app), pid), with a weak reference that tells a live app from a new one at a reused id.
        self.runtimes: dict[tuple[int, int], tuple[weakref.ref[Any], Runtime]] = {}
        self.lock = threading.Lock()
        self.starting: tuple[Any, str] | None = None


PROCESS = Process()


def own_lease(task: Any) -> Lease | None:
    """The lease of the body running for the task's own request (never a caller's)."""
    rt = current(task.app)
    return rt.lease_for(task.request) if rt is not None else None


def current(app: Any) -> Runtime | None:
    """This process's runtime for an app, if a leased body ever ran here."""
    entry = PROCESS.runtimes.get((id(app), os.getpid()))
    return entry[1] if entry is not None and entry[0]() is app else None


def for_delivery(task: Any, queue: str | None,
                 nesting: int = 0) -> tuple[Runtime, Store, TaskPolicy, stores.ClaimTerms]:
    """A delivery's runtime, store, task policy on ``queue`` and claim terms, resolved once per process."""
    key = (task.name, queue, nesting)
    runtime = current(task.app)
    known = runtime.deliveries.get(key) if runtime is not None else None
    if known is not None and known[0] is not None:
        return runtime, known[0], known[1], known[2]  # type: ignore[return-value]
    store = stores.for_app(task.app)
    runtime = for_app(task.app, store, task.request.hostname)
    if known is None:
        policy = task_policy(task, queue)
        # A store following a Django database is looked up per delivery: a test database may switch under it.
        fixed = store if app_config(task.app).database is None else None
        carried = messages.nesting_of if messages.carries_nesting(task.app) else None
        terms = stores.ClaimTerms.of(policy, nesting, carried=carried)
        known = runtime.deliveries[key] = (fixed, policy, terms)
    return runtime, store, known[1], known[2]


def for_app(app: Any, store: Store, hostname: str | None = None) -> Runtime:
    """This process's runtime for an app (a forked child gets its own)."""
    runtime = current(app)
    if runtime is None:
        with PROCESS.lock:
            runtime = current(app)
            if runtime is None:
                runtime = Runtime(store, hostname or socket.gethostname(), app_config(app).heartbeat_interval)
                PROCESS.runtimes[(id(app), os.getpid())] = (weakref.ref(app), runtime)
                app_state(app).retire = retire  # store.forget() calls it
    return runtime


def retire(app: Any) -> bool:
    """Stop and drop this process's runtime for an app unless it holds a lease; True when none is left."""
    with PROCESS.lock:
        runtime = current(app)
        if runtime is not None:
            runtime.deliveries.clear()  # the settings or the store changed: the next delivery reads them
        if runtime is not None and runtime.leases():
            return False
        PROCESS.runtimes.pop((id(app), os.getpid()), None)
    if runtime is not None:
        runtime.stop()
    return True


def in_process() -> list[Runtime]:
    return [rt for (_, owner), (_, rt) in list(PROCESS.runtimes.items()) if owner == os.getpid()]


def release_all_in_process(reason: Event = Event.RELEASED_ON_SHUTDOWN) -> int:
    """Shutdown: give back every lease of this process and stop its threads."""
    released = 0
    for runtime in in_process():
        try:
            count = runtime.release_all(reason)
            released += count
            if count:
                log.info("released %d lease(s) held by %s on shutdown", count, runtime.worker)
        finally:
            runtime.stop()
    return released
