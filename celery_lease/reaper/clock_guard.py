"""The reaper's guard against a store that was away or whose clock stepped.

After an outage or a forward clock step every owner looks gone, so a run that sees a step, a
backward move, a gap longer than ``lease_worker_stale_after`` or its own failure to reach the store
starts a hold: no owner counts as gone until it had a lease and a heartbeat to renew since.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Any

from ..app_state import app_state
from ..store import Store

__all__ = ["ClockGuard", "Hold", "host_clock"]

log = logging.getLogger(__name__)

BOOT_ID = "/proc/sys/kernel/random/boot_id"  # names this boot: monotonic times compare within it


def host_clock() -> str:
    """Which monotonic clock this process reads: its host and boot (or, unknown, its process)."""
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = f"pid{os.getpid()}"
    return f"{socket.gethostname()}/{boot}"


@dataclasses.dataclass(frozen=True)
class Hold:
    """The store counts as calm since ``since`` (its clock); ``reason`` when this run began the hold."""

    since: float | None = None
    reason: str | None = None
    step_back: bool = False

    def holds(self, now: float, lease: float, heartbeat: float) -> bool:
        """Whether an owner of a ``lease``-second lease has not yet had its time to renew."""
        return self.left(now, lease, heartbeat) > 0

    def left(self, now: float, lease: float, heartbeat: float) -> float:
        """Seconds the hold still covers an owner of a ``lease``-second lease (0 when it does not)."""
        return 0.0 if self.since is None else max(0.0, self.since + lease + heartbeat - now)


class ClockGuard:
    """Judges, once per run, whether the store was away or its clock stepped; in memory it keeps only
    what the store could not be told: that this process's reaper failed to reach it."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self._failed_at: float | None = None  # monotonic: the first failed call since a run

    @classmethod
    def for_app(cls, app: Any, tolerance: float) -> ClockGuard:
        """The guard of ``app``'s reapers in this process (the beat task builds a reaper per run)."""
        state = app_state(app)
        guard: ClockGuard | None = state.clock_guard
        if guard is None:
            guard = state.clock_guard = cls(tolerance)
        return guard

    def failed(self) -> None:
        """Note that this reaper could not reach the store (its run raised StoreUnavailable)."""
        if self._failed_at is None:
            self._failed_at = time.monotonic()

    def judge(self, store: Store, now: float, owner: str, stale_after: float,
              record: bool = True, mono: tuple[float, float] | None = None) -> Hold:
        """This run's hold, from the previous run's record; ``record`` writes this run's (a dry run only
        reads). ``mono``: this host's monotonic clock when ``now`` was read, and its error."""
        state = store.reaping.reaper_clock() or {}
        at, err = mono if mono is not None else (time.monotonic(), 0.0)
        reason, step = self._reason(state, now, at, err, stale_after)
        since = now if reason else state.get("calm_since")
        interval = state.get("interval")
        if step is None and "at" in state and now > float(state["at"]):
            # The usual gap between runs (a step is no gap). A gap that held this run back is an outage as
            # likely as a longer schedule: learnt at most twice the usual one at a time, so that an outage
            # does not become the usual gap that lets the next, shorter one pass unheld.
            gap, usual = now - float(state["at"]), float(interval or 0.0)
            interval = min(gap, 2 * usual) if reason and usual else gap
        hold = Hold(since, reason, step is not None and step < 0)
        if record:
            new = {"at": now, "mono": at, "mono_err": err, "host": host_clock(), "interval": interval,
                   "calm_since": since}
            store.reaping.record_reaper_clock(new, held_back=reason, owner=owner, step_back=hold.step_back)
            self._failed_at = None
        if reason and record:
            log.warning("reaper holds back: %s; no lease is taken back before its owner had its lease "
                        "duration and a heartbeat to renew", reason, extra={"action": "reaper_held_back"})
        return hold

    def _reason(self, state: dict[str, Any], now: float, mono: float, err: float,
                stale_after: float) -> tuple[str | None, float | None]:
        """Why a hold is needed (None: it is not), and the clock's step (seconds, negative backward)."""
        own = None if self._failed_at is None else (
            f"this reaper could not reach the store for {mono - self._failed_at:.1f}s before this run")
        if "at" not in state:
            return own, None
        gap = now - float(state["at"])
        if state.get("host") == host_clock() and "mono" in state:
            elapsed = mono - float(state["mono"])
            # Each run's monotonic reading may be off by half its clock read's round trip.
            if abs(gap - elapsed) > self.tolerance + err + float(state.get("mono_err") or 0.0):
                return (f"the store's clock stepped {gap - elapsed:+.1f}s between two reaper runs "
                        f"({gap:.1f}s on it, {elapsed:.1f}s on this host's monotonic clock)"), gap - elapsed
        if gap < -self.tolerance:
            return f"the store's clock stepped back {-gap:.1f}s behind the previous reaper run", gap
        if own is not None:
            return own, None
        usual = float(state.get("interval") or 0.0)
        limit = max(stale_after, 2 * usual)
        if gap > limit:
            return (f"no reaper run for {gap:.1f}s (more than {limit:g}s): the store may have been "
                    "unreachable, or no reaper ran"), None
        return None, None
