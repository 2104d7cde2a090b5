"""The demo's script: three workers, 20 jobs, one worker killed, another frozen past its lease.

Every step waits on something it can observe (a row in the executions table, an event
in the lease store, the broker's queue depth) with a deadline; the only timed pause is
the frozen worker's stall in plain mode, which has no reaper to wait for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import settings, tracking
from .processes import Proc, Processes

__all__ = ["Scenario", "Record", "ScenarioError", "WORKERS", "recovery_bound"]

WORKERS = ("w1", "w2", "w3")
REAPER_NODE = "reaper"
POLL = 0.05  # seconds between looks at observable state
READY_TIMEOUT = 60.0
STEP_TIMEOUT = 30.0
END_TIMEOUT = 90.0  # from the first publish to the last completion
# The 20 jobs, interleaved so that a payment and a report start at once.
JOBS = (
    "pay-1", "rpt-1", "order-1", "pay-2", "order-2", "rpt-2", "pay-3", "order-3", "pay-4", "order-4",
    "rpt-3", "pay-5", "order-5", "pay-6", "order-6", "rpt-4", "pay-7", "order-7", "pay-8", "order-8",
)


def recovery_bound() -> float:
    """Guarantee "no job is stuck": lease + grace + reaper interval + one heartbeat."""
    return (settings.lease_duration + settings.lease_grace_period + settings.REAPER_INTERVAL
            + settings.lease_heartbeat_interval)


class ScenarioError(RuntimeError):
    """The scenario could not be played (a worker did not start, a step never became possible)."""


@dataclasses.dataclass
class Published:
    job_id: str
    label: str
    task: str


@dataclasses.dataclass
class Action:
    at: float
    text: str


@dataclasses.dataclass
class Disruption:
    kind: str  # "kill" or "stop"
    node: str
    job_id: str
    label: str
    at: float
    execution_id: int  # the run it interrupted (tracking.executions.id)
    token: str  # that run's lease token prefix ("" in plain mode)
    resumed_at: float | None = None

    @classmethod
    def of(cls, kind: str, run: dict[str, Any]) -> Disruption:
        return cls(kind, run["node"], run["job_id"], run["label"], time.time(), run["id"], run["token"] or "")


@dataclasses.dataclass
class Sample:
    at: float
    statuses: dict[str, int]
    running: list[tuple[str, str]]


@dataclasses.dataclass
class Record:
    """Everything the timeline and the final table are made of."""

    mode: str
    t0: float = 0.0
    ended_at: float = 0.0
    settled: bool = False
    jobs: list[Published] = dataclasses.field(default_factory=list)
    actions: list[Action] = dataclasses.field(default_factory=list)
    disruptions: list[Disruption] = dataclasses.field(default_factory=list)
    samples: list[Sample] = dataclasses.field(default_factory=list)
    executions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    phases: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    statuses: dict[str, str] = dataclasses.field(default_factory=dict)
    captures: dict[str, int] = dataclasses.field(default_factory=dict)
    issued: dict[str, int] = dataclasses.field(default_factory=dict)

    def label(self, job_id: str | None) -> str:
        for job in self.jobs:
            if job.job_id == job_id:
                return job.label
        return (job_id or "?")[:8]


class Scenario:
    """Plays the scenario against real celery processes and records what happened."""

    def __init__(self, mode: str, app: Any, procs: Processes, say: Callable[[str], None]) -> None:
        self.mode, self.app, self.procs, self.say = mode, app, procs, say
        self.record = Record(mode)
        self.workers: dict[str, Proc] = {}
        self.store: Any = None
        if mode == "lease":
            from celery_lease.store import for_app

            self.store = for_app(app)
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    # -- helpers -------------------------------------------------------------------
    def act(self, text: str, at: float | None = None) -> None:
        now = at or time.time()
        self.record.actions.append(Action(now, text))
        self.say(f"  [{now - self.record.t0:5.1f}s] {text}" if self.record.t0 else f"  {text}")

    def _disrupted(self, kind: str | None = None) -> set[str]:
        return {d.node for d in self.record.disruptions if kind is None or d.kind == kind}

    def _check_processes(self) -> None:
        for proc in self.procs.procs:
            if proc.name not in self._disrupted("kill") and not proc.alive():
                raise ScenarioError(f"{proc.name} exited with status {proc.popen.returncode}; its log:\n"
                                    f"{proc.tail()}")

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            self._check_processes()
            if time.monotonic() >= deadline:
                raise ScenarioError(f"gave up after {timeout:g}s waiting for {what}")
            time.sleep(POLL)

    @contextlib.contextmanager
    def _between_writes(self) -> Iterator[None]:
        """On a SQLite store, hold its write lock while a worker is being frozen.

        SQLite has one write lock per file: a worker frozen in the middle of a write would keep
        it, and every other writer, the reaper too, would wait until it wakes (docs/guarantees.md,
        "The limits, plainly"). This step shows a lease outliving a silent worker, so it freezes
        the worker between two of its writes. PostgreSQL and MySQL lock rows, not the store.
        """
        if self.store is None or not self.store.dialect.single_writer:
            yield
            return
        with self.store.begin(long=True):
            yield

    def running(self, task: str | None = None) -> list[dict[str, Any]]:
        """Executions in progress on workers that were not killed."""
        dead = self._disrupted("kill")
        return [r for r in tracking.rows() if r["outcome"] is None and r["node"] not in dead
                and (task is None or r["task"] == task)]

    # -- the steps ----------------------------------------------------------------------
    def start(self) -> None:
        started = time.monotonic()
        names = list(WORKERS)
        for name in WORKERS:
            self.workers[name] = self.procs.worker(name, settings.task_default_queue)
        if self.mode == "lease":
            names.append(REAPER_NODE)
            self.procs.worker(REAPER_NODE, settings.MAINTENANCE_QUEUE, pool="solo")
            self.procs.beat()
        self.wait_until(lambda: set(names) <= set(tracking.nodes()), READY_TIMEOUT, "the workers to start")
        what = "3 workers" + (", the reaper's worker and beat" if self.mode == "lease" else "")
        self.say(f"  {what} ready in {time.monotonic() - started:.1f}s")

    def publish(self) -> None:
        from . import tasks

        self.record.t0 = time.time()
        self._start_sampler()
        for n, label in enumerate(JOBS):
            kind, number = label.split("-")
            if kind == "pay":
                task, args = tasks.capture_payment, (label, 1000 + 250 * int(number))
            elif kind == "order":
                task, args = tasks.issue_invoice, (label, 4000 + 100 * n)
            else:
                task, args = tasks.build_report, (label,)
            result = task.apply_async(args, idempotency_key=f"{task.name}:{label}")
            self.record.jobs.append(Published(result.id, label, task.name.rsplit(".", 1)[-1]))
        self.act(f"published {len(JOBS)} jobs: 8 payments, 8 invoices, 4 reports")

    def kill_mid_payment(self) -> None:
        """SIGKILL a whole worker right after it charged a card, before it finished the job."""
        run = self.wait_until(
            lambda: next((r for r in self.running("capture_payment") if r["phase"] == "captured"), None),
            STEP_TIMEOUT, "a worker in the middle of a payment",
        )
        kill = Disruption.of("kill", run)  # timed before the signal, so the timeline reads in order
        self.workers[run["node"]].signal(signal.SIGKILL)
        self.record.disruptions.append(kill)
        self.act(f"SIGKILL {run['node']} (main process and pool child) in the middle of {run['label']}: "
                 "the card is charged, the receipt not sent", kill.at)

    def stop_past_lease(self) -> None:
        """SIGSTOP another worker mid-report, keep it frozen past its lease, then SIGCONT it."""
        # Early in the report, before it extends its lease for rendering.
        early = tuple(f"step {n}/" for n in range(1, 4))
        run = self.wait_until(
            lambda: next((r for r in self.running("build_report")
                          if (r["phase"] or "").startswith(early)), None),
            STEP_TIMEOUT, "another worker in the middle of a report",
        )
        proc = self.workers[run["node"]]
        stop = Disruption.of("stop", run)
        with self._between_writes():
            proc.signal(signal.SIGSTOP)
            self.wait_until(proc.stopped, STEP_TIMEOUT, f"{run['node']} to stop")
        self.record.disruptions.append(stop)
        self.act(f"SIGSTOP {run['node']} at {run['label']} {run['phase']}: frozen, its heartbeat stops too",
                 stop.at)
        if self.store is not None:
            self.wait_until(lambda: self.store.reports.events(job_id=stop.job_id,
                                                              event="reaped_expired_lease"),
                            recovery_bound() + STEP_TIMEOUT, f"the reaper to take back {stop.label}")
        else:
            time.sleep(recovery_bound())  # plain Celery has nothing to wait for: stay frozen as long
        stop.resumed_at = time.time()
        proc.signal(signal.SIGCONT)
        self.act(f"SIGCONT {run['node']} after {stop.resumed_at - stop.at:.1f}s frozen", stop.resumed_at)
        self.wait_until(lambda: not any(r["id"] == run["id"] for r in self.running()),
                        STEP_TIMEOUT, f"{run['node']} to wake up and end its run of {run['label']}")

    def wait_for_end(self) -> None:
        """Lease mode: every job completed. Plain mode: the same, or nothing left that could run."""
        deadline = self.record.t0 + END_TIMEOUT
        quiet_since: float | None = None
        while time.time() < deadline:
            self._check_processes()
            if self._all_done():
                self.record.settled = True
                break
            if self.mode == "plain":
                if self._queue_depth() == 0 and not self.running():
                    quiet_since = quiet_since or time.time()
                    if time.time() - quiet_since >= recovery_bound():
                        self.record.settled = True
                        break
                else:
                    quiet_since = None
            time.sleep(POLL * 4)
        self.record.ended_at = time.time()
        self._sampling.set()
        if self._sampler is not None:
            self._sampler.join(5)
        if self.record.settled:
            self.act("every job is completed" if self._all_done() else
                     f"nothing left to run for {recovery_bound():g}s (queue empty, workers idle): stopping")
        else:
            self.act(f"stopping: jobs still unfinished {END_TIMEOUT:g}s after publishing")

    def _all_done(self) -> bool:
        finished = {r["job_id"] for r in tracking.rows() if r["outcome"] == tracking.FINISHED}
        if not all(job.job_id in finished for job in self.record.jobs):
            return False
        if self.store is None:
            return True
        return all((job := self.store.get(j.job_id)) is not None and job.status == "completed"
                   for j in self.record.jobs)

    def _queue_depth(self) -> int:
        with self.app.connection_for_read() as conn:
            # Not passive: Redis has no key for an empty list, so a passive declare would fail.
            declared = conn.default_channel.queue_declare(settings.task_default_queue, durable=True,
                                                          auto_delete=False)
            return int(declared.message_count)

    # -- the lease table, sampled -----------------------------------------------------------
    def _start_sampler(self) -> None:
        self._sampler = threading.Thread(target=self._sample_loop, name="demo-sampler", daemon=True)
        self._sampler.start()

    def _sample_loop(self) -> None:
        while not self._sampling.wait(0.5):
            statuses: dict[str, int] = {}
            if self.store is not None:  # the run's own store: every row is one of its jobs
                for _queue, status, count in self.store.reports.job_counts():
                    statuses[status] = statuses.get(status, 0) + count
            running = [(r["node"], r["label"]) for r in self.running()]
            self.record.samples.append(Sample(time.time(), statuses, running))

    # -- what happened ---------------------------------------------------------------------
    def collect(self) -> Record:
        from . import gateway, shop

        rec = self.record
        rec.executions = tracking.rows()
        rec.phases = tracking.phases()
        rec.captures = gateway.captures()
        rec.issued = shop.issued()
        if self.store is not None:
            rec.events = self.store.reports.events(limit=1_000_000)
            for job in rec.jobs:
                row = self.store.get(job.job_id)
                rec.statuses[job.job_id] = row.status if row else "missing"
        return rec
