"""Prometheus metrics over the lease store: a collector and a small HTTP exporter.

Counters and histograms count from when the exporter started, so run one exporter per store.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..config import METRICS_MAX_SERIES
from ..errors import StoreRejected, StoreUnavailable
from ..store.runs import EXPORTER_SCRAPE
from ..vocabulary import STALE_WRITES, Event, stale_write

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["LeaseCollector", "make_exporter", "metric_names", "COUNTERS", "LAG_BUCKETS",
           "RUNTIME_BUCKETS", "ATTEMPT_BUCKETS"]

log = logging.getLogger(__name__)

LAG_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RUNTIME_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
ATTEMPT_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0)
EVENT_LAG = 5.0  # seconds; longer than any transaction that writes an event or finishes a job
UNKNOWN, OTHER = "unknown", "other"  # label values: writer did not know the job; over the cap

#: Counter name (without _total), help, extra label name, {event: extra label value}.
COUNTERS: tuple[tuple[str, str, str | None, dict[Event, str]], ...] = (
    ("celery_lease_reaped", "Expired leases the reaper took back and requeued (event reaped_expired_lease).",
     None, {Event.REAPED_EXPIRED_LEASE: ""}),
    ("celery_lease_redispatched", "Pending jobs whose lost message the reaper re-published.",
     None, {Event.REDISPATCHED: ""}),
    ("celery_lease_dead_lettered", "Jobs that ended failed: the task failed for good (task_failure) "
     "or the reaper gave up on an expired lease (lease_expired).",
     "cause", {Event.FAILED: "task_failure", Event.DEAD_LETTERED: "lease_expired"}),
    ("celery_lease_released", "Leases given back before expiry (worker shutdown, Reject with requeue).",
     "reason", {Event.RELEASED_ON_SHUTDOWN: "shutdown", Event.REJECTED_REQUEUE: "rejected"}),
    ("celery_lease_duplicate_deliveries_skipped", "Deliveries of a leased or finished job whose body "
     "did not run.", None, {Event.DUPLICATE_DELIVERY_SKIPPED: ""}),
    ("celery_lease_stale_writes_rejected", "Writes of a worker that had lost its lease, rejected by "
     "the token check.", "write", {e: stale_write(e) for e in STALE_WRITES}),
    ("celery_lease_leases_taken_over", "Expired leases a delivery took over directly.",
     None, {Event.LEASE_TAKEN_OVER: ""}),
    ("celery_lease_leases_lost", "Leases a worker found lost at its heartbeat.",
     None, {Event.LEASE_LOST: ""}),
    ("celery_lease_reap_skipped_owner_alive", "Expired leases the reaper left alone because their "
     "owner was alive.", None, {Event.REAP_SKIPPED_OWNER_ALIVE: ""}),
    ("celery_lease_manual_requeues", "Jobs requeued by `celery lease requeue`.",
     None, {Event.MANUAL_REQUEUE: ""}),
    ("celery_lease_dlq_redriven", "Dead letters sent back by `celery lease dlq redrive`.",
     None, {Event.DLQ_REDRIVEN: ""}),
)
EVENT_NAMES = tuple(event for *_, events in COUNTERS for event in events)
_BY_EVENT = {event: (name, value if label else None) for name, _, label, events in COUNTERS
             for event, value in events.items()}
#: Histogram key -> (name, help, bounds).
HISTOGRAMS = {
    "runtime": ("celery_lease_task_runtime_seconds", "Runtime of completed jobs (completed_at - "
                "started_at), counted as they complete.", RUNTIME_BUCKETS),
    "attempts": ("celery_lease_task_attempts", "Attempts jobs took, counted as they complete or fail "
                 "for good.", ATTEMPT_BUCKETS),
    "lag": ("celery_lease_heartbeat_lag_seconds", "Time since each running job's last heartbeat, "
            "observed once per running job at every scrape.", LAG_BUCKETS),
}


def prometheus() -> Any:
    """The prometheus_client module, or ImportError with the install hint."""
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:
        raise ImportError(
            "celery_lease metrics need prometheus_client: pip install celery-lease[metrics]"
        ) from exc
    return prometheus_client


def _le(bound: float) -> str:
    return prometheus().utils.floatToGoString(bound)


def metric_names(families: Iterable[Any]) -> set[str]:
    """Every sample name the given families expose, whether or not they hold samples now."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {f.name + suffix for f in families for suffix in suffixes.get(f.type, ("",))}


class _Histogram:
    """Cumulative bucket counts, sum and count of one label set (non-cumulative per bucket inside)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.counts = [0.0] * (len(bounds) + 1)
        self.total = 0.0

    def add(self, values: Sequence[float]) -> None:
        """Add per-bucket counts (then the +Inf bucket, then the sum), as the store reads them."""
        for i, n in enumerate(values[:-1]):
            self.counts[i] += n
        self.total += values[-1]

    def buckets(self, bounds: Sequence[float]) -> list[tuple[str, float]]:
        out, running = [], 0.0
        for le, n in zip([*map(_le, bounds), "+Inf"], self.counts, strict=True):
            running += n
            out.append((le, running))
        return out


class _Cap:
    """Label pairs (queue, task) of one metric: the first ``limit`` seen, then ``other``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen: dict[str, set[tuple[str, str]]] = {}

    def __call__(self, metric: str, queue: str | None, task: str | None) -> tuple[str, str]:
        pair = (queue or UNKNOWN, task or UNKNOWN)
        seen = self.seen.setdefault(metric, set())
        if pair in seen:
            return pair
        if len(seen) < self.limit:
            seen.add(pair)
            return pair
        return (OTHER, OTHER)


class LeaseCollector:
    """A prometheus_client collector over one app's lease store; each scrape is noted for `lease check`."""

    def __init__(self, app: Any, store: Store | None = None, event_lag: float = EVENT_LAG,
                 max_series: int = METRICS_MAX_SERIES, record_scrapes: bool = True) -> None:
        from ..store import for_app

        self.store: Store = store if store is not None else for_app(app, check=False)
        self.event_lag, self.record_scrapes = event_lag, record_scrapes
        self.whoami = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._through: float | None = None
        self._cap = _Cap(max_series)
        self._totals: dict[str, dict[tuple[str, ...], float]] = {name: {} for name, *_ in COUNTERS}
        self._histograms: dict[str, dict[tuple[str, str], _Histogram]] = {k: {} for k in HISTOGRAMS}

    def _families(self) -> dict[str, Any]:
        core = prometheus().core
        g = core.GaugeMetricFamily
        qt = ["queue", "task"]
        fams = {
            "running": g("celery_lease_running_jobs", "Jobs running under a lease.", labels=qt),
            "expired": g("celery_lease_running_expired_jobs", "Running jobs whose lease has expired: "
                         "zombie candidates the reaper should take back.", labels=qt),
            "oldest": g("celery_lease_oldest_running_seconds", "Age of the oldest running job "
                        "(seconds since its attempt started).", labels=qt),
            "lag_max": g("celery_lease_heartbeat_lag_max_seconds", "Longest time since a running "
                         "job's last heartbeat.", labels=qt),
            "pending": g("celery_lease_pending_jobs", "Jobs waiting for a worker (queue depth).",
                         labels=["queue"]),
            "oldest_pending": g("celery_lease_oldest_pending_seconds", "How long the oldest due "
                                "pending job has waited past its available_at.", labels=["queue"]),
            "alive": g("celery_lease_workers_alive", "Worker processes whose heartbeat is recent "
                       "(within lease_worker_stale_after)."),
            "stale": g("celery_lease_workers_stale", "Registered worker processes whose heartbeat is "
                       "older than lease_worker_stale_after."),
            "reaper_last": g("celery_lease_reaper_last_run_timestamp_seconds", "When the reaper last "
                             "finished a run (store clock, epoch seconds); 0 when no run is recorded."),
            "reaper_duration": g("celery_lease_reaper_last_run_duration_seconds", "How long the "
                                 "reaper's last recorded run took."),
            "up": g("celery_lease_store_up", "1 when the last scrape could read the lease store."),
            "duration": g("celery_lease_scrape_duration_seconds", "Seconds the last scrape took."),
        }
        for key, (name, doc, _) in HISTOGRAMS.items():
            fams[key] = core.HistogramMetricFamily(name, f"{doc} Counted since the exporter started.",
                                                   labels=qt)
        for name, doc, label, _ in COUNTERS:
            fams[name] = core.CounterMetricFamily(
                name, f"{doc} Counted since the exporter started.", labels=qt + ([label] if label else []))
        return fams

    def describe(self) -> Iterator[Any]:
        """The families without touching the store (registration stays cheap)."""
        yield from self._families().values()

    def collect(self) -> Iterator[Any]:
        fams = self._families()
        started = time.monotonic()
        try:
            self._fill(fams)
            if self.record_scrapes:
                self.store.runs.set_meta(EXPORTER_SCRAPE, self.whoami)
            fams["up"].add_metric([], 1.0)
        except (StoreUnavailable, StoreRejected) as exc:
            log.warning("metrics scrape could not read the lease store: %s", exc,
                        extra={"action": "metrics_store_unavailable"})
            fams = {k: v for k, v in fams.items() if k in ("up", "duration")}
            fams["up"].add_metric([], 0.0)
        fams["duration"].add_metric([], time.monotonic() - started)
        yield from fams.values()

    def _fill(self, fams: dict[str, Any]) -> None:
        store = self.store
        now, running = store.reports.running_metrics(LAG_BUCKETS)
        now, pending = store.reports.pending_metrics()
        workers = store.reports.worker_counts()
        _, last_run = store.runs.last_reaper_run()
        with self._lock:
            # First: a scrape whose window read fails observes nothing, not even the heartbeat lags.
            self._advance(now)
            # The running gauges share one label cap: past it, their pairs add up (or take the max) as other.
            gauges: dict[tuple[str, str], list[float]] = {}
            for r in running:
                oldest = r["oldest_started_at"]
                age = max(0.0, now - oldest) if oldest is not None else 0.0
                pair = self._cap("celery_lease_running_jobs", r["queue"], r["task"])
                n, expired, old, lag = gauges.setdefault(pair, [0, 0, 0.0, 0.0])
                gauges[pair] = [n + r["running"], expired + r["expired"], max(old, age),
                                max(lag, r["lag_max"])]
                lags = r["lag_buckets"]  # cumulative counts per bound
                per_bucket = [b - a for a, b in zip([0, *lags], [*lags, r["running"]], strict=True)]
                self._observe("lag", r["queue"], r["task"], [*per_bucket, r["lag_sum"]])
            for pair, values in gauges.items():
                for key, value in zip(("running", "expired", "oldest", "lag_max"), values, strict=True):
                    fams[key].add_metric(list(pair), value)
            for key, (_, _, bounds) in HISTOGRAMS.items():
                for (queue, task), hist in sorted(self._histograms[key].items()):
                    fams[key].add_metric([queue, task], hist.buckets(bounds), hist.total)
            for name, *_ in COUNTERS:
                for counted, n in sorted(self._totals[name].items()):
                    fams[name].add_metric(list(counted), n)
        for r in pending:
            due = r["oldest_due_at"]
            fams["pending"].add_metric([r["queue"] or UNKNOWN], r["pending"])
            fams["oldest_pending"].add_metric([r["queue"] or UNKNOWN], max(0.0, now - due) if due else 0.0)
        fams["alive"].add_metric([], workers["alive"])
        fams["stale"].add_metric([], workers["stale"])
        fams["reaper_last"].add_metric([], float(last_run["finished_at"]) if last_run else 0.0)
        if last_run is not None:
            fams["reaper_duration"].add_metric([], float(last_run["duration"]))

    def _observe(self, key: str, queue: str | None, task: str | None, values: Sequence[float]) -> None:
        name, _, bounds = HISTOGRAMS[key]
        labels = self._cap(name, queue, task)
        self._histograms[key].setdefault(labels, _Histogram(bounds)).add(values)

    def _advance(self, now: float) -> None:
        """Count what finished in (previous scrape, now - event_lag]: the lag covers late commits.

        Every read of the window comes before anything is counted, and the window moves on only
        after all of it is: a failed read counts nothing, and the next scrape reads the same window.
        """
        until = now - self.event_lag
        if self._through is None:
            # What was written before the exporter started is history, not counted: from now on.
            self._through = now
            return
        if until <= self._through:
            return
        finished = self.store.reports.finished_between(self._through, until, RUNTIME_BUCKETS, ATTEMPT_BUCKETS)
        counts = self.store.reports.labelled_event_counts(EVENT_NAMES, self._through, until)
        for (finished_queue, finished_task), data in finished.items():
            for key, values in data.items():
                self._observe(key, finished_queue, finished_task, values)
        for (event, queue, task), n in counts.items():
            name, extra = _BY_EVENT[Event(event)]
            labels = (*self._cap(name, queue, task), *(() if extra is None else (extra,)))
            self._totals[name][labels] = self._totals[name].get(labels, 0.0) + n
        self._through = until


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("exporter: %s", format % args)


def make_exporter(app: Any, port: int = 9808, addr: str = "0.0.0.0", **options: Any) -> WSGIServer:
    """An HTTP server answering Prometheus scrapes for the app's lease store (call ``serve_forever()``)."""
    pc = prometheus()
    registry = pc.CollectorRegistry(auto_describe=True)
    registry.register(LeaseCollector(app, **options))
    return make_server(addr, port, pc.make_wsgi_app(registry), _ThreadingWSGIServer, _QuietHandler)
