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
HOSTS_KEPT = 8  # the most recent hosts whose last reading the record keeps: the meta row stays small
# NTP keeps each clock's rate within 500 ppm of true, so the store's clock and this host's monotonic clock may
# part by 0.1% of the time between two readings: over a reading hours old, more than the tolerance.
RATE_DRIFT = 0.001


def host_clock() -> str:
    """Which monotonic clock this process reads: its host and boot (or, unknown, its process)."""
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = f"pid{os.getpid()}"
    return f"{socket.gethostname()}/{boot}"


def _readings(state: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each host's last reading of both clocks (at, mono, mono_err), oldest first; a record of the previous
    version (no ``hosts``) holds only its last run's."""
    hosts = state.get("hosts")
    if not isinstance(hosts, dict):
        hosts = {state["host"]: state} if "host" in state else {}
    readings: dict[str, dict[str, float]] = {}
    for host, r in hosts.items():
        if isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) for k in ("at", "mono")):
            readings[str(host)] = {"at": float(r["at"]), "mono": float(r["mono"]),
                                   "mono_err": float(r.get("mono_err") or 0.0)}
    return readings


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
        me, readings = host_clock(), _readings(state)
        reason, step = self._reason(state, readings.get(me), now, at, err, stale_after)
        since = now if reason else state.get("calm_since")
        interval = state.get("interval")
        if step is None and "at" in state and now > float(state["at"]):
            # The usual gap between runs (a step is no gap). A calm gap only lowers it: one spanning a dropped
            # beat would double the gap, and the forward step within it, let pass by a host with no reading
            # of its own. A gap that held this run back is an outage as likely as a longer schedule: learnt
            # at most twice the usual one at a time, so an outage does not let the next, shorter one pass.
            gap, usual = now - float(state["at"]), float(interval or 0.0)
            interval = min(gap, 2 * usual if reason else usual) if usual else gap
        hold = Hold(since, reason, step is not None and step < 0)
        if record:
            # A run that holds back keeps only its own reading: the others were read before what it held back
            # for, and each of those hosts would hold back again for the same step.
            kept = {} if reason else {host: r for host, r in readings.items() if host != me}
            kept[me] = {"at": now, "mono": at, "mono_err": err}
            # The top-level mono and host are the last run's, as the previous version reads them.
            new = {"at": now, "mono": at, "mono_err": err, "host": me, "interval": interval,
                   "calm_since": since, "hosts": dict(list(kept.items())[-HOSTS_KEPT:])}
            store.reaping.record_reaper_clock(new, held_back=reason, owner=owner, step_back=hold.step_back)
            self._failed_at = None
        if reason and record:
            log.warning("reaper holds back: %s; no lease is taken back before its owner had its lease "
                        "duration and a heartbeat to renew", reason, extra={"action": "reaper_held_back"})
        return hold

    def _reason(self, state: dict[str, Any], mine: dict[str, float] | None, now: float, mono: float,
                err: float, stale_after: float) -> tuple[str | None, float | None]:
        """Why a hold is needed (None: it is not), and the clock's step (seconds, negative backward).
        ``mine``: this host's last reading, whichever hosts ran since: a step shows on its monotonic clock."""
        own = None if self._failed_at is None else (
            f"this reaper could not reach the store for {mono - self._failed_at:.1f}s before this run")
        if "at" not in state:
            return own, None
        if mine is not None:
            passed, elapsed = now - mine["at"], mono - mine["mono"]
            # Each run's monotonic reading may be off by half its clock read's round trip.
            step = passed - elapsed
            if abs(step) > self.tolerance + err + mine["mono_err"] + RATE_DRIFT * abs(elapsed):
                return (f"the store's clock stepped {step:+.1f}s since this host's last reaper run "
                        f"({passed:.1f}s on it, {elapsed:.1f}s on this host's monotonic clock)"), step
        gap = now - float(state["at"])
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
