"""Prometheus metrics over the lease store: a read-only collector and a small HTTP exporter.

A scrape runs a handful of indexed aggregate queries: running jobs (bounded by the
work in flight), pending jobs per queue (bounded by the backlog), the newest
finished jobs within ``window`` seconds and ``limit`` rows, the worker registry,
and the audit events written since the previous scrape (a range of the
``(event, at)`` index per name). Event counters count from when the exporter
started, like any process counter; they lag the store's clock by ``event_lag``
seconds so that an event whose transaction commits late is still counted once.

``prometheus_client`` is an optional dependency: ``pip install celery-lease[metrics]``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from .errors import StoreUnavailable
from .vocabulary import STALE_WRITES, Event, stale_write

if TYPE_CHECKING:
    from .store import ReportStore

__all__ = ["LeaseCollector", "make_exporter", "COUNTERS", "LAG_BUCKETS", "RUNTIME_BUCKETS"]

log = logging.getLogger(__name__)

LAG_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RUNTIME_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
ATTEMPT_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0)
WINDOW = 900.0  # seconds of finished jobs that the runtime and attempts histograms cover
LIMIT = 5_000  # finished rows per status at most in those histograms
EVENT_LAG = 5.0  # seconds; longer than any transaction that writes an event

#: Counter name (without _total), help, label name, {event: label value}.
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


def _buckets(bounds: Sequence[float], counts: Sequence[int], total: int) -> list[tuple[str, float]]:
    return [(_le(b), float(n)) for b, n in zip(bounds, counts, strict=True)] + [("+Inf", float(total))]


class LeaseCollector:
    """A prometheus_client collector over one app's lease store (read-only)."""

    def __init__(self, app: Any, store: ReportStore | None = None, window: float = WINDOW, limit: int = LIMIT,
                 event_lag: float = EVENT_LAG) -> None:
        from .store import for_app

        self.store: ReportStore = store if store is not None else for_app(app, check=False)
        self.window, self.limit, self.event_lag = window, limit, event_lag
        self._lock = threading.Lock()
        self._through: float | None = None
        self._totals = dict.fromkeys(EVENT_NAMES, 0)

    # -- families ------------------------------------------------------------
    def _families(self) -> dict[str, Any]:
        core = prometheus().core
        g, gh = core.GaugeMetricFamily, core.GaugeHistogramMetricFamily
        qt = ["queue", "task"]
        fams = {
            "running": g("celery_lease_running_jobs", "Jobs running under a lease.", labels=qt),
            "expired": g("celery_lease_running_expired_jobs", "Running jobs whose lease has expired: "
                         "zombie candidates the reaper should take back.", labels=qt),
            "oldest": g("celery_lease_oldest_running_seconds", "Age of the oldest running job "
                        "(seconds since its attempt started).", labels=qt),
            "lag_max": g("celery_lease_heartbeat_lag_max_seconds", "Longest time since a running "
                         "job's last heartbeat.", labels=qt),
            "lag": gh("celery_lease_heartbeat_lag_seconds", "Running jobs by time since their last "
                      "heartbeat (a snapshot).", labels=qt),
            "pending": g("celery_lease_pending_jobs", "Jobs waiting for a worker (queue depth).",
                         labels=["queue"]),
            "oldest_pending": g("celery_lease_oldest_pending_seconds", "How long the oldest due "
                                "pending job has waited past its available_at.", labels=["queue"]),
            "alive": g("celery_lease_workers_alive", "Worker processes whose heartbeat is recent "
                       "(within lease_worker_stale_after)."),
            "stale": g("celery_lease_workers_stale", "Registered worker processes whose heartbeat is "
                       "older than lease_worker_stale_after."),
            "attempts": gh("celery_lease_attempts", f"Attempts of jobs finished in the last {self.window:g}s "
                           f"(at most {self.limit} per status).", labels=["task"]),
            "runtime": gh("celery_lease_task_runtime_seconds", "Runtime of jobs completed in the last "
                          f"{self.window:g}s (at most {self.limit}): completed_at - started_at.",
                          labels=["task"]),
            "up": g("celery_lease_store_up", "1 when the last scrape could read the lease store."),
            "duration": g("celery_lease_scrape_duration_seconds", "Seconds the last scrape took."),
        }
        for name, doc, label, _ in COUNTERS:
            fams[name] = core.CounterMetricFamily(
                name, f"{doc} Counted since the exporter started.", labels=[label] if label else [])
        return fams

    def describe(self) -> Iterator[Any]:
        """The families without touching the store (registration stays cheap)."""
        yield from self._families().values()

    def collect(self) -> Iterator[Any]:
        fams = self._families()
        started = time.monotonic()
        try:
            self._fill(fams)
            fams["up"].add_metric([], 1.0)
        except StoreUnavailable as exc:
            log.warning("metrics scrape could not read the lease store: %s", exc,
                        extra={"action": "metrics_store_unavailable"})
            fams = {k: v for k, v in fams.items() if k in ("up", "duration")}
            fams["up"].add_metric([], 0.0)
        fams["duration"].add_metric([], time.monotonic() - started)
        yield from fams.values()

    # -- the queries -------------------------------------------------------------
    def _fill(self, fams: dict[str, Any]) -> None:
        store = self.store
        now, running = store.running_metrics(LAG_BUCKETS)
        for r in running:
            labels = [r["queue"] or "", r["task"]]
            fams["running"].add_metric(labels, r["running"])
            fams["expired"].add_metric(labels, r["expired"])
            oldest = r["oldest_started_at"]
            fams["oldest"].add_metric(labels, max(0.0, now - oldest) if oldest is not None else 0.0)
            fams["lag_max"].add_metric(labels, max(0.0, r["lag_max"]))
            fams["lag"].add_metric(labels, _buckets(LAG_BUCKETS, r["lag_buckets"], r["running"]),
                                   r["lag_sum"])
        now, pending = store.pending_metrics()
        for r in pending:
            due = r["oldest_due_at"]
            fams["pending"].add_metric([r["queue"] or ""], r["pending"])
            fams["oldest_pending"].add_metric([r["queue"] or ""], max(0.0, now - due) if due else 0.0)
        workers = store.worker_counts()
        fams["alive"].add_metric([], workers["alive"])
        fams["stale"].add_metric([], workers["stale"])
        finished = store.finished_metrics(RUNTIME_BUCKETS, ATTEMPT_BUCKETS, self.window, self.limit)
        for task, data in sorted(finished.items()):
            if "runtime" in data:
                n, total, counts = data["runtime"]
                fams["runtime"].add_metric([task], _buckets(RUNTIME_BUCKETS, counts, n), total)
            if "attempts" in data:
                n, total, counts = data["attempts"]
                fams["attempts"].add_metric([task], _buckets(ATTEMPT_BUCKETS, counts, n), total)
        totals = self._event_totals(now)
        for name, _, label, events in COUNTERS:
            if label is None:
                fams[name].add_metric([], float(sum(totals[e] for e in events)))
            else:
                for event, value in events.items():
                    fams[name].add_metric([value], float(totals[event]))

    def _event_totals(self, now: float) -> dict[str, int]:
        """Add the events of (previous scrape, now - event_lag] to the running totals."""
        until = now - self.event_lag
        with self._lock:
            if self._through is None:
                self._through = until
            elif until > self._through:
                counts = self.store.event_counts(EVENT_NAMES, self._through, until)
                for event, n in counts.items():
                    self._totals[event] += n
                self._through = until
            return dict(self._totals)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("exporter: %s", format % args)


def make_exporter(app: Any, port: int = 9808, addr: str = "0.0.0.0", **options: Any) -> WSGIServer:
    """An HTTP server answering Prometheus scrapes for the app's lease store; call
    ``serve_forever()`` on it (and ``shutdown()`` from another thread to stop)."""
    pc = prometheus()
    registry = pc.CollectorRegistry(auto_describe=True)
    registry.register(LeaseCollector(app, **options))
    return make_server(addr, port, pc.make_wsgi_app(registry), _ThreadingWSGIServer, _QuietHandler)
