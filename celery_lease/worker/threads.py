"""The worker's helper threads, all of one shape: ``Loop``, a named daemon thread that runs a step until
stopped (the visibility refresher and the store probe use it too), and the two every runtime starts: the
heartbeat (one statement renews all the process's leases, confirmed from when it was sent, deadline.py)
and the deadline timer (leases and locks lost at their local deadlines however long a store call takes),
with the writes (cancels, a lost child's completion) the store did not take.

A step that raises goes to ``failed`` inside the ``except`` (so it can log the traceback): one bad round
never ends the thread. A forked child sees the parent's thread dead, so its first start starts its own;
``threading`` is looked up at each start, so under gevent the loop is a greenlet of the hub."""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import celery_lease.deadline as deadline

from ..errors import LeaseError, StoreRejected, StoreUnavailable
from ..vocabulary import LossReason
from .handles import RuntimeHandle

if TYPE_CHECKING:
    from ..store import Store
    from .lease import Lease

__all__ = ["WRITES_KEPT", "MAX_TIMER_SLEEP", "DeadlineTimer", "Heartbeat", "Loop", "PendingWrites", "Step",
           "worker_id"]

# Each keeps the logger name its records had before the three modules became one: log filters go on working.
log = logging.getLogger("celery_lease.worker.heartbeat")
timer_log = logging.getLogger("celery_lease.worker.timers")

Step = Callable[[], "float | None"]  # a round: the seconds until the next one (None: until a wake)


class _Run:
    """One started thread with its own stop flag and wake-up event, so a thread winding down after ``stop()``
    never eats a wake meant for its successor."""

    def __init__(self, name: str, delay: float | None, target: Callable[[_Run], None]) -> None:
        self.stopping = threading.Event()
        self.woken = threading.Event()
        self.delay = delay
        self.thread = threading.Thread(target=target, args=(self,), name=name, daemon=True)


class Loop:
    """A named daemon thread calling ``step`` every time it returns, until ``stop()``."""

    def __init__(self, name: str, step: Step, failed: Step) -> None:
        self.name = name
        self._step = step
        self._failed = failed
        self._starting = threading.Lock()
        self._run: _Run | None = None

    @property
    def thread(self) -> threading.Thread | None:
        run = self._run
        return run.thread if run is not None else None

    @property
    def woken(self) -> threading.Event | None:
        """The running thread's wake-up event, set until its next round begins (tests read it)."""
        run = self._run
        return run.woken if run is not None else None

    def running(self) -> bool:
        run = self._run
        return run is not None and run.thread.is_alive() and not run.stopping.is_set()

    def start(self, delay: float | None = 0.0) -> None:
        """Start the thread unless it runs (one starts, however many threads ask; one told to stop does not
        count); its first round comes after ``delay`` seconds."""
        with self._starting:
            if self.running():
                return
            self._run = _Run(self.name, delay, self._loop)
            self._run.thread.start()

    def wake(self) -> None:
        """Run the next round now (or as soon as the one under way ends)."""
        run = self._run
        if run is not None:
            run.woken.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Tell the thread to stop, wake it and wait for it (from the loop's own thread, only tell)."""
        run = self._run
        if run is None:
            return
        run.stopping.set()
        run.woken.set()
        if run.thread is not threading.current_thread():
            run.thread.join(timeout)

    def _loop(self, run: _Run) -> None:
        pause = run.delay
        while True:
            run.woken.wait(pause)
            run.woken.clear()
            if run.stopping.is_set():
                return
            try:
                pause = self._step()
            except Exception:  # noqa: BLE001 - the thread must outlive any one bad round
                pause = self._failed()



def worker_id(hostname: str | None = None, pid: int | None = None) -> str:
    """The id of one worker process: its Celery node name and pid."""
    return f"{hostname or socket.gethostname()}:{pid or os.getpid()}"


class Heartbeat:
    """Renews a runtime's leases; ``beat()`` is one round, ``start()`` the loop."""

    def __init__(self, runtime: RuntimeHandle) -> None:
        self.runtime = runtime
        self.store = runtime.store
        self.worker = runtime.worker
        self.beats = 0
        self._planned_interval = runtime.default_interval
        self._last_beat = float("-inf")  # when the loop's last round ended (monotonic)
        self._loop = Loop("celery-lease-heartbeat", self._round, self._round_failed)
        # Held from a round's snapshot of the durations to its confirms, and by an extend() from its statement
        # to its confirm: a round whose statement wrote the duration from before an extend, committed after
        # it, would leave the lease trusting the extend's longer lease while the row holds the shorter one.
        self.renewing = threading.Lock()

    def joined(self, lease: Lease) -> None:
        """A lease joined: wake the thread if it needs beats sooner than planned."""
        if lease.renew_every < self._planned_interval:
            self._loop.wake()

    def beat(self) -> dict[str, int]:
        """Renew every held lease once; returns counts (held, renewed, lost, past_max_runtime)."""
        rt = self.runtime
        now = deadline.monotonic()
        held: list[Lease] = rt.leases()
        renewable = [lease for lease in held if lease.renewable(now)]
        counts = {"held": len(held), "renewed": 0, "lost": 0,
                  "past_max_runtime": sum(1 for lease in held if lease.past_max_runtime(now))}
        with self.renewing:
            # An extended lease's duration goes with each renewal: a row that lost its extend (a failover, a
            # row recorded again) gets it back, and a lease trusts no longer than the duration its renewal
            # wrote.
            durations = {lease.token: lease.duration for lease in renewable}
            extended = {lease.token: durations[lease.token] for lease in renewable
                        if durations[lease.token] != lease.policy.duration}
            sent = deadline.monotonic()
            try:
                leases = {lease.token: lease.job_id for lease in renewable}
                renewed = self.store.jobs.beat(self.worker, rt.hostname, os.getpid(), leases,
                                               extended or None)
            except StoreUnavailable as exc:
                log.warning("heartbeat of %s could not reach the lease store: %s", self.worker, exc,
                            extra={"action": "heartbeat_store_unavailable"})
                return counts
            except StoreRejected as exc:
                # Unrenewed, each lease lapses at its local deadline, as in an outage.
                log.error("heartbeat of %s refused by the lease store: %s", self.worker, exc,
                          extra={"action": "heartbeat_store_rejected"})
                return counts
            self.beats += 1
            for lease in renewable:
                if self._renewed(lease, renewed, renewable):
                    if lease.confirm(sent, cap=durations[lease.token]):
                        counts["renewed"] += 1
                    # else: lost locally while the statement was out; the runtime gives it back.
                elif (lease.finishing or lease.handed_over) and not rt.is_deferred(lease):
                    # The body's end or hand-over cleared the token between snapshot and renewal: no loss.
                    continue
                elif rt.is_deferred(lease) and self.store.get(lease.job_id) is not None:
                    # A deferred write's first try may have committed unanswered: flush_deferred decides.
                    continue
                else:
                    with lease.turn:
                        if lease.handed_over or lease.retried:
                            continue  # the body handed the job on while this round was out
                        reason, owner = self.store.jobs.describe_loss(lease.job_id, lease.token, self.worker)
                        if reason == LossReason.VANISHED and lease.recorded_again():
                            continue
                        lease.mark_lost(reason, owner)
                    rt.forget(lease)
                    counts["lost"] += 1
        rt.give_back_lost()
        rt.unanswered.release(self.store, self.worker)
        rt.flush_deferred()
        rt.flush_checkpoints()
        try:
            rt.locks.renew(now)
        except LeaseError as exc:
            log.warning("resource lock renewal of %s failed: %s", self.worker, exc)
        return counts

    def _renewed(self, lease: Lease, renewed: set[str], renewable: list[Lease]) -> bool:
        if lease.job_id not in renewed:
            return False
        if Counter(other.job_id for other in renewable)[lease.job_id] == 1:
            return True
        # The same job claimed twice here (stale and new): the statement returns job ids, so ask the row.
        job = self.store.get(lease.job_id)
        return job is not None and job.lock_token == lease.token

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._loop.stop(timeout)
        self._last_beat = float("-inf")  # a restarted loop beats at once

    def _round(self) -> float:
        """Beat if the interval passed since the last round (a wake may come sooner); plan the next."""
        if deadline.monotonic() >= self._last_beat + self.runtime.interval:
            self.beat()
            self._last_beat = deadline.monotonic()
        return self._plan()

    def _round_failed(self) -> float:
        log.exception("heartbeat round of %s failed", self.worker)
        self._last_beat = deadline.monotonic()
        return self._plan()

    def _plan(self) -> float:
        self._planned_interval = self.runtime.interval
        return max(0.0, self._last_beat + self._planned_interval - deadline.monotonic())

MAX_TIMER_SLEEP = 5.0  # seconds the timer sleeps with no deadline in sight
WRITES_KEPT = 10_000  # writes the store did not take that a process remembers (the newest)


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
        timer_log.exception("deadline timer of %s failed", self.runtime.worker)
        return self._plan(None)

    def _plan(self, upcoming: float | None) -> float:
        """Sleep to the next deadline exactly; a new lease or a stop wakes the loop earlier."""
        now = deadline.monotonic()
        pause = MAX_TIMER_SLEEP if upcoming is None else min(max(0.0, upcoming - now), MAX_TIMER_SLEEP)
        self._planned = now + pause
        return pause


# The log's action of a kept write, by kind: kept while the store is away, then written.
_DEFERRED = {"cancel": {"action": "cancel_deferred"}, "completion": {"action": "completion_deferred"},
             "dead letter": {"action": "dead_letter_deferred"}}
_WRITTEN = {"cancel": {"action": "cancel_written"}, "completion": {"action": "completion_written"},
            "dead letter": {"action": "dead_letter_written"}}


class PendingWrites:
    """Writes the store did not take because it was unreachable, made once it answers: the cancels of
    revoked jobs (Celery acks a revoked delivery whatever the store said: a lost cancel would leave the
    job pending for the dispatch scan to run), and the completions of jobs whose pool child died after
    Celery stored their SUCCESS (Celery acks those too: a lost completion would let the reaper run the
    body again)."""

    def __init__(self, store: Store, interval: float) -> None:
        self.store = store
        self.interval = interval
        self._mutex = threading.Lock()
        # One flush at a time (the loop's, or a new write's): a dead letter made twice is sent twice.
        self._flushing = threading.Lock()
        # (job id, what the write is) -> the write
        self._kept: collections.OrderedDict[tuple[str, str], Callable[[], object]] = collections.OrderedDict()
        self._loop = Loop("celery-lease-kept-writes", self._retry, self._retry_failed)

    def __len__(self) -> int:
        with self._mutex:
            return len(self._kept)

    def cancel(self, job_id: str, reason: str, owner: str | None = None, task_name: str | None = None,
               queue: str | None = None) -> bool:
        """Cancel ``job_id`` now, or keep it for when the store answers; True when written now."""
        order: dict[str, Any] = {"reason": reason, "owner": owner, "task_name": task_name, "queue": queue}
        return self.write(job_id, "cancel", lambda: self.store.jobs.cancel(job_id, **order))

    def write(self, job_id: str, what: str, write: Callable[[], object]) -> bool:
        """Make ``write``, the store call named ``what`` ("cancel", "completion") for ``job_id``, now, or keep
        it for when the store answers; True when made now. While writes are kept a new one joins them
        without a call, so an outage costs a revoke one call bound."""
        self.flush()
        if len(self):
            self._keep(job_id, what, write)
            return False
        try:
            write()
        except StoreRejected as exc:
            timer_log.error("job %s: the store rejected its %s (%s); not retried", job_id, what, exc)
            return False
        except StoreUnavailable as exc:
            self._keep(job_id, what, write)
            timer_log.warning("job %s: lease store unreachable (%s); its %s is kept and made when the store "
                              "answers", job_id, exc, what, extra=_DEFERRED[what])
            return False
        return True

    def keep(self, job_id: str, what: str, write: Callable[[], object]) -> None:
        """Keep ``write``, which just found the store down, for when it answers (retried every interval)."""
        self._keep(job_id, what, write)
        timer_log.warning("job %s: lease store unreachable; its %s is kept and written when the store "
                          "answers", job_id, what, extra=_DEFERRED[what])

    def _keep(self, job_id: str, what: str, write: Callable[[], object]) -> None:
        with self._mutex:
            # By job and kind: a revoke's cancel kept after a lost child's completion must not replace it.
            self._kept[(job_id, what)] = write
            self._kept.move_to_end((job_id, what))
            while len(self._kept) > WRITES_KEPT:
                (dropped, lost), _ = self._kept.popitem(last=False)
                timer_log.error("job %s: too many writes kept while the store is down; its %s is dropped",
                                dropped, lost)
            self._loop.start(delay=self.interval)

    def flush(self) -> int:
        """Make the kept writes, oldest first; stops at the first that finds the store down."""
        with self._flushing:
            return self._flush()

    def _flush(self) -> int:
        with self._mutex:
            kept = list(self._kept.items())
        written = 0
        for (job_id, what), write in kept:
            try:
                write()
            except StoreRejected as exc:
                timer_log.error("job %s: the store rejected its kept %s (%s); dropped", job_id, what, exc)
            except StoreUnavailable:
                return written
            except Exception as exc:  # noqa: BLE001 - not the store: retried, it would block every later write
                timer_log.error("job %s: its kept %s failed (%s); dropped", job_id, what, exc)
            else:
                written += 1
                timer_log.info("job %s: kept %s made after the store came back", job_id, what,
                               extra=_WRITTEN[what])
            with self._mutex:
                if self._kept.get((job_id, what)) is write:
                    del self._kept[(job_id, what)]
        return written

    def _retry(self) -> float:
        self.flush()
        return self._again()

    def _retry_failed(self) -> float:
        timer_log.exception("kept writes: flush failed")
        return self._again()

    def _again(self) -> float:
        """Try again in ``interval`` seconds while a cancel is kept; else end the loop."""
        with self._mutex:
            if not self._kept:
                # Under the mutex: a cancel kept from now on starts a new loop.
                self._loop.stop()
            return self.interval
