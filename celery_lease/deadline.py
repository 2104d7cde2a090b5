"""The local lease deadline: when a worker stops trusting its lease, on its own clock.

A renewal (or the claim) sent at local monotonic time ``s`` and confirmed by the store
makes the row expire at ``e + duration`` on the store's clock, where ``e`` is when the
statement ran, after ``s``. The reaper takes the lease back only past expiry + grace on
that clock. The worker's clock may run at a slightly different rate than the store's
(``DRIFT``, a fraction of elapsed time), and the body needs a moment to notice a loss
(``NOTICE``: how late the deadline timer may run and the interruption land). So the
worker calls its lease lost at::

    s + duration - margin,   margin = DRIFT * duration + NOTICE

which is, for any statement time and any rate within DRIFT, before the store can see the
lease expired (see README, "One live owner"). Nothing here waits on the store.

A resource lock gets the same deadline with its TTL for the duration. The store lets another
job take a lock at its expiry itself (no grace), which the inequality covers with grace 0.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DRIFT", "NOTICE", "monotonic", "safety_margin", "local_deadline", "store_takeover_local_time",
           "seconds_until"]

# The clock seam tests may replace; local intervals only, so monotonic.
monotonic: Callable[[], float] = time.monotonic

#: Largest rate difference between the worker's monotonic clock and the store's clock,
#: as a fraction (1%: NTP keeps real clocks within 0.05%; a margin of twenty times that).
DRIFT = 0.01
#: Seconds the deadline timer may run late and the body take to see LeaseLost.
NOTICE = 0.1


def safety_margin(duration: float) -> float:
    """Seconds before the store-side expiry that a lease of ``duration`` counts as lost locally."""
    return DRIFT * duration + NOTICE


def local_deadline(sent_at: float, duration: float) -> float:
    """Local monotonic time past which a lease renewed by a statement sent at ``sent_at`` is lost."""
    return sent_at + duration - safety_margin(duration)


def store_takeover_local_time(sent_at: float, ran_after: float, duration: float, grace: float,
                              rate: float) -> float:
    """Local time at which the store first lets another worker take the lease.

    ``ran_after``: store seconds between the send and the statement's execution (>= 0);
    ``rate``: local seconds per store second (within 1 +/- DRIFT). Used by the proofs in
    the tests and the README's numbers, not at run time.
    """
    return sent_at + rate * (ran_after + duration + grace)


def seconds_until(when: Any) -> float:
    """Seconds from now to an ``eta`` (datetime or ISO 8601 string) or a ``countdown``."""
    if when is None:
        return 0.0
    if isinstance(when, str):
        # Celery accepts an ISO 8601 string as eta.
        when = datetime.datetime.fromisoformat(when)
    if isinstance(when, datetime.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
    return max(0.0, float(when))
