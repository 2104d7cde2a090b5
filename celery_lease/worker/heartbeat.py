"""The renewal round of a worker process's runtime: every interval one statement renews all its leases
(confirmed from when it was sent, deadline.py) and its registry row, and the leases it did not renew are
marked lost."""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from typing import TYPE_CHECKING

import celery_lease.deadline as deadline

from ..errors import LeaseError, StoreRejected, StoreUnavailable
from ..vocabulary import LossReason
from .handles import RuntimeHandle
from .loop import Loop

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["Heartbeat", "worker_id"]

log = logging.getLogger(__name__)


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

    def joined(self, lease: Lease) -> None:
        """A lease joined: wake the thread if it needs beats sooner than planned."""
        if lease.policy.heartbeat_interval < self._planned_interval:
            self._loop.wake()

    def beat(self) -> dict[str, int]:
        """Renew every held lease once; returns counts (held, renewed, lost, past_max_runtime)."""
        rt = self.runtime
        now = deadline.monotonic()
        held: list[Lease] = rt.leases()
        renewable = [lease for lease in held if lease.renewable(now)]
        counts = {"held": len(held), "renewed": 0, "lost": 0,
                  "past_max_runtime": sum(1 for lease in held if lease.past_max_runtime(now))}
        sent = deadline.monotonic()
        try:
            renewed = self.store.jobs.beat(self.worker, rt.hostname, os.getpid(),
                                           {lease.token: lease.job_id for lease in renewable})
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
                if lease.confirm(sent):
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
                    again = deadline.monotonic()
                    reason, owner = self.store.jobs.describe_loss(lease.job_id, lease.token, self.worker)
                    if reason == LossReason.VANISHED and lease.recorded_again():
                        lease.confirm(again)
                        continue
                    lease.mark_lost(reason, owner)
                rt.forget(lease)
                counts["lost"] += 1
        rt.give_back_lost()
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
