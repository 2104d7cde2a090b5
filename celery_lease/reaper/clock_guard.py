"""The reaper's guard against a store that was away or whose clock stepped.

No owner counts as gone until it had a lease's time to renew against the store as it is now.

An owner looks gone when its renewals did not land: after an outage every owner does, and
after a forward step of the store's clock every lease looks old. So each reaper run compares
the store's clock with the previous run's, as recorded in the store (any reaper process, one
at a time under the reaper lock), and starts a **hold** when

- the store's clock moved by more or less than this host's monotonic clock between the two
  runs, by more than ``lease_clock_tolerance`` (a step, forward or backward; only comparable
  when both runs ran on one host since its boot);
- it moved backward (whichever host ran the previous run);
- nobody recorded a run for longer than ``lease_worker_stale_after`` (and than twice the usual
  gap between runs): the store may have been unreachable, or no reaper ran. A shorter gap
  cannot hurt: a live owner whose last renewal came a heartbeat before the gap began is, at
  its end, neither past lease + grace nor stale (config.derive_stale_after);
- or this process's reaper could not reach the store since its last run, for however long.

While a hold lasts no lease is taken back whose owner has not had its whole lease duration
plus a heartbeat since the hold began to renew against the store as it is now: a live owner
renews within that time, a dead one is recovered one lease later than it would have been.
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
        return self.since is not None and now < self.since + lease + heartbeat


class ClockGuard:
    """Judges, once per run, whether the store was away or its clock stepped; keeps its state in
    the store, and in memory only what the store could not be told: that this process's reaper
    failed to reach it (one guard per app and process, see ``for_app``)."""

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
        """This run's hold, from the previous run's record; ``record`` writes this run's (and the
        hold's one event) in the store, a dry run only reads. ``stale_after``: the registry
        silence after which an owner looks gone (config.worker_stale_after). ``mono``: this
        host's monotonic clock when ``now`` was read, and how far off it may be (half the read's
        round trip); by default read now, taken as exact."""
        state = store.reaping.reaper_clock() or {}
        at, err = mono if mono is not None else (time.monotonic(), 0.0)
        reason, step = self._reason(state, now, at, err, stale_after)
        since = now if reason else state.get("calm_since")
        interval = state.get("interval")
        if step is None and "at" in state and now > float(state["at"]):
            interval = now - float(state["at"])  # the usual gap between runs; a step is no gap
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
        """Why the store's history since the previous run calls for a hold (None: it does not),
        and the step of its clock when it stepped (seconds, negative backward)."""
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
