"""Delays that double and stop at a cap; jittered where one incident's jobs would otherwise all come
back at the same instant."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["backoff", "store_retry_delay", "dispatch_wait", "MAX_DOUBLINGS"]

MAX_DOUBLINGS = 64  # 2**64 times any base is past every cap; more would only overflow


def _doubled(base: float, times: int, cap: float) -> float:
    return min(cap, base * 2.0 ** min(max(times, 0), MAX_DOUBLINGS))


def backoff(attempt: int, base: float, cap: float, jitter: bool, rng: Any = random) -> float:
    """Seconds before attempt ``attempt + 1``: ``base * 2**(attempt - 1)`` capped, full jitter."""
    ceiling = _doubled(base, max(attempt, 1) - 1, cap)
    return rng.uniform(0.0, ceiling) if jitter else ceiling


def store_retry_delay(retries: int, base: float, cap: float, rng: Any = random) -> float:
    """Seconds before a delivery that found the store unreachable is sent again: equal jitter, so each
    wait is at least half the step and one outage's deliveries spread."""
    ceiling = _doubled(base, retries, max(cap, base))
    return ceiling / 2.0 + rng.uniform(0.0, ceiling / 2.0)


def dispatch_wait(timeout: float, dispatches: int, cap: float) -> float:
    """Seconds a pending job waits past ``available_at`` before the dispatch scan re-sends its message."""
    return max(timeout, _doubled(timeout, dispatches, cap))
