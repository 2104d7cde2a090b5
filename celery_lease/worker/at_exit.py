"""At a process's exit, the settle writes an outage deferred are made until each lands, or its lease's local
deadline passes (the job may be another's then), or the exit has waited ``config.EXIT_SETTLE_WAIT``: a write
dropped silently would leave its finished body to run again."""

from __future__ import annotations

import logging
from typing import Any

import celery_lease.deadline as deadline

from ..config import EXIT_SETTLE_WAIT
from .lease import MAX_STORE_WAIT

__all__ = ["settle_before_exit"]

log = logging.getLogger("celery_lease.worker.runtime")


def settle_before_exit(rt: Any) -> None:
    """Flush ``rt``'s deferred settle writes, backing off, until none is left or each one's time is up (its
    lease's local deadline as the exit began, capped: renewals meanwhile never delay the exit)."""
    cap = deadline.monotonic() + EXIT_SETTLE_WAIT
    ends = {lease: min(lease.deadline, cap) for lease in rt.leases() if rt.is_deferred(lease)}
    pause = 0.05
    while True:
        rt.flush_deferred()
        now = deadline.monotonic()
        left = [lease for lease in ends if rt.is_deferred(lease)]
        for lease in [lease for lease in left if ends[lease] <= now]:
            rt.forget(lease)
            log.error("job %s [%s]: deferred %s dropped at exit, the store unreachable until then; it runs "
                      "again once its lease expires", lease.job_id, lease.token[:8],
                      lease.deferred and lease.deferred.end, extra={"action": "settle_lost_at_exit"})
        due = min((ends[lease] for lease in left if ends[lease] > now), default=None)
        if due is None:
            return
        rt.wait_drained(min(due - now, pause))  # woken early once the heartbeat lands the last one
        pause = min(pause * 2, MAX_STORE_WAIT)
