"""The local lease deadline: when a worker stops trusting its lease, on its own clock.

A renewal sent at local time ``s`` expires in the store after ``s + duration``; so, for any clock
rate within ``DRIFT``, ``s + duration - (DRIFT * duration + NOTICE)`` comes before the store can see the
lease (or a resource lock, grace 0) expired (docs/guarantees.md, "One live owner").
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
    """Local time at which the store first lets another worker take the lease (for the tests' proofs)."""
    return sent_at + rate * (ran_after + duration + grace)


def seconds_until(when: Any) -> float:
    """Seconds from now to an ``eta`` (datetime or ISO 8601 string) or a ``countdown``."""
    if when is None:
        return 0.0
    if isinstance(when, str):
        when = datetime.datetime.fromisoformat(when)
    if isinstance(when, datetime.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
    return max(0.0, float(when))
