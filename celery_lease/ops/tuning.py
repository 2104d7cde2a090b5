"""Lease tuning from measured runtimes: percentiles per task and recommended settings.

Percentiles are computed in Python over the newest runs: SQLite and MariaDB have no ``percentile_cont``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..config import TaskPolicy, app_config, task_policy

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["percentile", "TaskTuning", "tune_task", "tune", "SAMPLE_LIMIT", "LONG_JOB"]

SAMPLE_LIMIT = 10_000
#: Seconds of p99 runtime above which a job relies on its heartbeat rather than a lease
#: longer than the run: a two-hour lease would take two hours to recover a crash.
LONG_JOB = 300.0
NEAR_LEASE = 0.8  # p99 runtime at this fraction of the lease "nears" it
FEW_SAMPLES = 20


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated; the one every report uses, so they agree on a p99."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _up(seconds: float) -> float:
    """Round a recommendation up to a whole second (a tenth below one second)."""
    return math.ceil(seconds) if seconds >= 1 else math.ceil(seconds * 10) / 10


@dataclasses.dataclass(frozen=True)
class TaskTuning:
    """Measured percentiles, the settings in force and the recommended ones for one task."""

    task: str
    queue: str | None
    samples: int
    runtime_p50: float | None
    runtime_p95: float | None
    runtime_p99: float | None
    runtime_max: float | None
    heartbeat_gap_p99: float | None
    current: dict[str, Any]
    recommended: dict[str, Any]
    warnings: list[str]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def recommend(p99: float, gap_p99: float, policy: TaskPolicy) -> dict[str, Any]:
    """Lease settings for a measured task: short jobs get twice their p99 (no renewal needed), long ones a
    short renewed lease (a crash is recovered quickly)."""
    interval = policy.heartbeat_interval
    floor = max(3 * interval, 3 * gap_p99, 1.0)
    duration = _keep(policy.duration, _up(max(2 * p99, floor) if p99 <= LONG_JOB else max(floor, 60.0)),
                     1.0, 1.5)
    heartbeat = _keep(interval, max(math.floor(duration / 3 * 10) / 10, 0.1), 0.25, 1.0)
    grace = _keep(policy.grace_period, _up(max(heartbeat, gap_p99 - interval, 1.0)), 1.0, 3.0)
    max_runtime = _keep(policy.max_runtime, _up(max(3 * p99, duration)), 1.0, 3.0)
    return {"lease_duration": duration, "lease_heartbeat_interval": heartbeat,
            "lease_grace_period": grace, "lease_max_runtime": max_runtime}


def _keep(current: float | None, wanted: float, low: float, high: float) -> float:
    """The current value when within [wanted * low, wanted * high], else ``wanted``: no churn."""
    if current is not None and wanted * low <= current <= wanted * high:
        return current
    return wanted


def tune_task(task: str, policy: TaskPolicy, runtimes: Sequence[float], gaps: Sequence[float],
              queue: str | None = None) -> TaskTuning:
    """Percentiles, recommendations and warnings for one task's sample."""
    current = {k: v for k, v in policy.as_settings().items()
               if k in ("lease_duration", "lease_heartbeat_interval", "lease_grace_period",
                        "lease_max_runtime")}
    p50, p95, p99 = (percentile(runtimes, q) for q in (50, 95, 99))
    gap = percentile(gaps, 99)
    warnings: list[str] = []
    recommended: dict[str, Any] = {}
    if p99 is None:
        warnings.append("no completed jobs to measure yet; keep the current settings")
    else:
        recommended = recommend(p99, gap or 0.0, policy)
        if len(runtimes) < FEW_SAMPLES:
            # A cap is a hard stop: drawn from a few runs it would stop the rare long one the sample missed.
            del recommended["lease_max_runtime"]
            warnings.append(f"only {len(runtimes)} completed jobs measured; percentiles are rough, and no "
                            f"lease_max_runtime is recommended below {FEW_SAMPLES}")
        headroom = policy.duration - (gap or 0.0)
        if p99 >= NEAR_LEASE * policy.duration and headroom < policy.heartbeat_interval:
            warnings.append(
                f"p99 runtime {p99:.3g}s nears the lease ({policy.duration:g}s) and the heartbeat leaves "
                f"{max(headroom, 0):.3g}s of headroom (less than one interval, "
                f"{policy.heartbeat_interval:g}s): one late beat loses the lease; raise lease_duration "
                f"to {recommended['lease_duration']:g}s or beat more often"
            )
        if gap is not None and gap > policy.duration / 2:
            warnings.append(
                f"heartbeat gap p99 {gap:.3g}s is over half the lease ({policy.duration:g}s): the "
                "heartbeat thread is starved (blocking C code, solo pool, overloaded host?)"
            )
        if p99 > LONG_JOB and policy.max_runtime is None:
            warnings.append(f"long job (p99 {p99:.3g}s) without lease_max_runtime: a hung body keeps "
                            "its lease forever; set a time_limit or lease_max_runtime")
    return TaskTuning(task, queue, len(runtimes), p50, p95, p99, max(runtimes) if runtimes else None,
                      gap, current, recommended, warnings)


def tune(app: Any, store: Store, task: str | None = None,
         limit: int = SAMPLE_LIMIT) -> list[TaskTuning]:
    """Tune every LeaseTask of the app that has completed jobs (or one task)."""
    from ..integration.task import LeaseTask

    names = [task] if task else sorted(set(store.reports.finished_tasks(limit)) | {
        name for name, t in app.tasks.items() if isinstance(t, LeaseTask) and not name.startswith("celery.")})
    _, running = store.reports.running_rows()
    alive = store.reports.alive_workers()
    results = []
    for name in names:
        sample = store.reports.runtime_sample(name, limit)
        queues = Counter(q for _, _, q in sample if q)
        queue = queues.most_common(1)[0][0] if queues else None
        registered = app.tasks.get(name)
        if registered is not None and isinstance(registered, LeaseTask):
            policy = task_policy(registered, queue)
        else:
            policy = app_config(app).policy(queue=queue)
        gaps = [g for _, g, _ in sample]
        # A dead owner's lag is its death, not a heartbeat gap: only live owners count.
        gaps += [r["heartbeat_lag"] for r in running
                 if r["task"] == name and r["owner"] in alive and r["heartbeat_lag"] is not None]
        result = tune_task(name, policy, [r for r, _, _ in sample], gaps, queue)
        if registered is None:
            result.warnings.append("not registered in this app: showing the app-wide settings")
        results.append(result)
    return results
