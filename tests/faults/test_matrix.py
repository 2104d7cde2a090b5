"""The fault matrix: every (point x fault mode) pair, as jobs in shared real workers, settled and checked.

Each job carries its scenario (run kind, the verb and ordinal of the call to fail, the mode);
the workers' store and result-backend calls pass tests/faults/injector.py, which fails exactly
that call as the driver would. A clean job of every kind runs beside them: each faulted job
must end as the clean one of its kind did (store status, Celery state and result; ``failed``
also allowed for a rejection), with no two bodies overlapping, the body's end reached at most
once, each effect and link callback at most once, a completed job's effect done (or its
key audited unconfirmed), and as many dead letters as the clean run sent. Pairs listed in
known_failing.txt must fail (strictly: one that passes fails the run, so the list only shrinks as
fixes land).

``FAULTS_SEED`` replays a run's lane; ``FAULTS_RECORD=1`` writes its failing pairs to
known_failing.<store>.txt (merged by hand into known_failing.txt: tagged by store, and flaky
where runs disagreed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis
import sqlalchemy as sa

from celery_lease.errors import StoreUnavailable
from celery_lease.store import Store
from tests.conftest import unique_prefix
from tests.faults import injector, matrix
from tests.faults.injector import REJECT_MODES
from tests.faults.matrix import KINDS, Outcome, Point
from tests.helpers import poll, wait_for
from tests.workers import beat, celery_processes, worker

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]

APP_FILE = Path(__file__).resolve().parents[1] / "apps" / "faults_app.py"
CONCURRENCY = {"prefork": 4, "threads": 6}


class Lane:
    """A store, its worker and beat, and the test process's twin of their app (for publishing)."""

    def __init__(self, name: str, pool: str, store_url: str, redis_url: str, log_dir: Path,
                 group_commit: bool = False) -> None:
        self.name, self.pool, self.store_url = name, pool, store_url
        self.prefix, self.queue = unique_prefix(), f"faults_{uuid.uuid4().hex[:8]}"
        self.env = {"FAULTS_BROKER": redis_url, "FAULTS_REDIS": redis_url, "FAULTS_STORE": store_url,
                    "FAULTS_PREFIX": self.prefix, "FAULTS_QUEUE": self.queue,
                    # Read by tests/apps when the worker starts: lease_group_commit on.
                    "TESTS_GROUP_COMMIT": "1" if group_commit else "0"}
        self.store = Store(store_url, self.prefix)
        self.store.migrate()
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            spec = importlib.util.spec_from_file_location(f"faults_app_{name}", APP_FILE)
            assert spec is not None and spec.loader is not None
            self.mod: Any = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self.mod)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.mod.app.conf.lease_fault_injector = None  # this process only publishes
        self.log_dir = log_dir
        self.jobs: dict[str, tuple[str, Point | None, str]] = {}  # job -> (kind, point, mode)
        self.clean: dict[str, str] = {}  # kind -> job id of its clean run
        # job -> the call its fault had fired at when its duplicate was sent (None: not yet).
        self.duplicated: dict[str, bytes | None] = {}

    def start(self, procs: list) -> None:
        procs.append(worker("tests.apps.faults_app", self.env, self.log_dir, pool=self.pool,
                            concurrency=CONCURRENCY[self.pool], queues=self.queue,
                            name=f"faults-{self.name}"))
        procs.append(beat("tests.apps.faults_app", self.env, self.log_dir, name=f"beat-{self.name}"))

    def publish(self, r: redis.Redis, kind: str, point: Point | None, mode: str) -> str:
        job = uuid.uuid4().hex
        scenario = {"kind": kind, "verb": point.verb if point else None,
                    "ordinal": point.ordinal if point else 0, "mode": mode}
        r.set(f"faults:scenario:{job}", json.dumps(scenario), ex=3600)
        options: dict[str, Any] = {"queue": self.queue}
        if kind == "revoke":
            # The revoke broadcast below must reach the worker before the countdown ends: on a
            # loaded machine 2 s was once not enough, and the clean run completed unrevoked.
            options["countdown"] = 4
        if kind == "duplicate":
            options["link"] = self.mod.linked.s(job)
        task = {"started": self.mod.tracked, "revoke": self.mod.revocable}.get(kind, self.mod.run)
        # On SQLite the workers' writes may hold the database past the publish's call bound on a
        # loaded machine: the publish fails closed (nothing sent), and is made again.
        deadline = time.monotonic() + 30
        while True:
            try:
                task.apply_async((scenario,), task_id=job, **options)
                break
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
        if kind == "revoke":
            self.mod.app.control.revoke(job)
        self.jobs[job] = (kind, point, mode)
        if mode == "clean":
            self.clean[kind] = job
        return job

    def settle(self, r: redis.Redis, jobs: set[str]) -> set[str]:
        """The jobs of ``jobs`` not final yet (one query and one MGET for all of them)."""
        t = self.store.t.jobs
        with self.store.begin(read=True) as c:
            status = dict(c.execute(sa.select(t.c.id, t.c.status).where(t.c.id.in_(jobs))).all())
        order = sorted(jobs)
        metas = dict(zip(order, r.mget([f"celery-task-meta-{job}" for job in order]), strict=True))
        return {job for job in jobs if not self._final(r, job, status.get(job), metas[job])}

    def _final(self, r: redis.Redis, job: str, status: str | None, meta: bytes | None) -> bool:
        kind = self.jobs[job][0]
        state = json.loads(meta)["status"] if meta else "PENDING"
        if status is None and matrix.forgotten_after_end(*self.jobs[job][1:]):
            return state in ("SUCCESS", "FAILURE")  # the fault deleted the finished job's row
        if status not in ("completed", "failed"):
            return False
        if kind == "duplicate" and job in self.duplicated:  # its result was deleted: see below
            fired = r.get(f"faults:fired:{job}")
            if fired and self.forgets(job):  # the duplicate runs as a first delivery
                return state in ("SUCCESS", "FAILURE")
            if fired == b"event#1":  # the skip's audit event was the call that failed: nothing follows it
                return True
            seen = {e["event"] for e in self.store.reports.events(job)}
            return bool(seen & {"duplicate_delivery_skipped", "post_run_resumed"})
        if state not in ("SUCCESS", "FAILURE", "REVOKED"):
            return kind == "ignore"  # Ignore stores no state: the store's final status is the end
        if kind == "duplicate":
            if job not in self.duplicated:
                # The result expired: its key is gone and the completion is older than
                # result_expires (a day back on the store's clock). A duplicate arrives.
                r.delete(f"celery-task-meta-{job}")
                t = self.store.t.jobs
                with self.store.begin() as c:
                    c.execute(sa.update(t).where(t.c.id == job)
                              .values(completed_at=t.c.completed_at - 2 * 86400))
                self.mod.app.send_task("faults.run", args=(self.jobs_scenario(r, job),), task_id=job,
                                       queue=self.queue, link=self.mod.linked.s(job))
                self.duplicated[job] = r.get(f"faults:fired:{job}")
            return False
        return True

    def forgets(self, job: str) -> bool:
        """Whether the job's fault made the store forget it had finished (matrix.FORGOTTEN): its point is one
        of those, and it fired in the duplicate delivery. With lease_group_commit a neighbour's fault can send
        a job's first run down its outage path, whose heartbeat reads the row: the point's call then comes in
        the first run, where a vanished row is recorded again and the duplicate is skipped as usual."""
        _, point, mode = self.jobs[job]
        return matrix.forgotten(point, mode) and job in self.duplicated and self.duplicated[job] is None

    @staticmethod
    def jobs_scenario(r: redis.Redis, job: str) -> dict:
        return json.loads(r.get(f"faults:scenario:{job}"))

    def close(self, r: redis.Redis, redis_url: str) -> None:
        for job in self.jobs:
            r.delete(*[f"faults:{name}:{job}" for name in ("scenario", "fired", "seen", "runs", "body",
                                                           "linked", "outage", "effect:" + job + ":k1")],
                     *[f"faults:calls:{job}:{verb}" for verb in injector.VERBS | matrix.BACKEND_VERBS],
                     f"celery-task-meta-{job}")
        with kombu.Connection(redis_url) as conn:
            kombu.Queue(self.queue, channel=conn.default_channel).delete()
            kombu.Queue(f"{self.queue}_dlq", channel=conn.default_channel).delete()
        self.store.drop_schema()
        self.store.engine.dispose()
        self.mod.app.close()


def _observed(lane: Lane, r: redis.Redis) -> set[Point]:
    """The points the clean runs walked (heartbeat verbs: their first call only)."""
    seen = set()
    for kind, job in lane.clean.items():
        for call in r.lrange(f"faults:seen:{job}", 0, -1):
            verb, ordinal = call.decode().split("#")
            if verb in matrix.PERIODIC_VERBS and int(ordinal) > 1:
                continue
            seen.add(Point(kind, verb, int(ordinal)))
    return seen


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("FAULTS_SEED") or random.SystemRandom().randrange(10_000))
    matrix.REPORT.append(f"fault matrix seed {value} (FAULTS_SEED={value} replays its lane)")
    return value


@pytest.mark.parametrize("grouped", [False, True], ids=["seed_lane", "group_commit"])
def test_every_fault_point_leaves_each_job_as_its_clean_run_left_it(
        seed, grouped, redis_url, postgres_url, mysql_url, tmp_path):
    pool, store_kind = matrix.lane_of(seed, grouped)
    main_url = postgres_url if store_kind == "postgres" else f"sqlite:///{tmp_path / 'faults.sqlite3'}"
    r = redis.Redis.from_url(redis_url)
    all_points, _ = matrix.read_points()
    known, flaky = matrix.read_known_failing(store_kind)
    # FAULTS_KINDS=revoke,duplicate: only those run kinds (to iterate on a fix; make test runs all).
    kinds = tuple(k for k in KINDS if k in (os.environ.get("FAULTS_KINDS") or k).split(","))
    points = [p for p in all_points if p.kind in kinds]
    known = {pair: why for pair, why in known.items() if pair.split()[0] in kinds}
    flaky = {pair for pair in flaky if pair.split()[0] in kinds}
    r.delete(injector.BATCHED)
    lanes = {"main": Lane("main", pool, main_url, redis_url, tmp_path, grouped),
             "reject": Lane("reject", pool, mysql_url, redis_url, tmp_path)}
    started = time.monotonic()
    try:
        with celery_processes(tmp_path) as procs:
            for lane in lanes.values():
                lane.start(procs)
            for lane in lanes.values():  # a revoke broadcast before a worker listens is lost
                wait_for(lambda lane=lane: lane.mod.app.control.ping(timeout=0.5), timeout=60,
                         message=f"the {lane.name} worker never answered a ping")
            for lane in lanes.values():
                for kind in kinds:
                    lane.publish(r, kind, None, "clean")
            for point in points:
                for mode in matrix.modes_of(point):
                    lanes["reject" if mode in REJECT_MODES else "main"].publish(r, point.kind, point, mode)
            published = time.monotonic()
            pending = {name: set(lane.jobs) for name, lane in lanes.items()}
            dead: list[str] = []

            def settled_or_dead() -> bool:
                nonlocal pending, dead
                pending = {name: lanes[name].settle(r, jobs) if jobs else jobs
                           for name, jobs in pending.items()}
                # A worker or beat that exited leaves jobs unsettled for reasons of the harness,
                # not of the library: say so instead of listing them as failing pairs.
                dead = [f"{p.name} exited with {p.exited()} (log {p.log})" for p in procs
                        if p.exited() is not None]
                return not any(pending.values()) or bool(dead)

            poll(settled_or_dead, matrix.SETTLE_BOUND, 0.5)
            assert not dead, "a process of the fault matrix ended early:\n" + "\n".join(dead)
            settle = time.monotonic() - published
            unsettled = sorted(f"{point or kind + ' clean_run#0'} {mode} [job {job}]"
                               for name, jobs in pending.items() for job in jobs
                               for kind, point, mode in [lanes[name].jobs[job]])
            failures, unreached, ran, jobs_of = {}, [], 0, {}
            for lane in lanes.values():
                cleans = {kind: Outcome.read(job, lane.store, lane.mod.app, r)
                          for kind, job in lane.clean.items()}
                clean_breaks = {kind: matrix.broken(clean, clean, "clean") for kind, clean in cleans.items()}
                for kind, why in clean_breaks.items():
                    if why:  # judged once, as the kind's clean run; its pairs are judged on the rest
                        failures[f"{kind} clean_run#0 clean"] = "; ".join(why)
                for job, (kind, point, mode) in lane.jobs.items():
                    if point is None:
                        continue
                    ran += 1
                    outcome = Outcome.read(job, lane.store, lane.mod.app, r)
                    pair = matrix.pair_name(point, mode)
                    judged = point
                    if matrix.forgotten(point, mode) and not lane.forgets(job):
                        judged = None  # its call came in the first run (Lane.forgets): an ordinary vanish
                        if outcome.fired is not None:
                            matrix.REPORT.append(f"  {matrix.pair_name(point, mode)}: fired in the first run "
                                                 f"(at {outcome.fired}), judged as a vanished row there")
                    why = [w for w in matrix.broken(outcome, cleans[kind], mode, judged)
                           if w not in clean_breaks[kind]]
                    if outcome.fired is None:
                        # The call was not made in this run (its ordinal depends on timing), or it
                        # wrote nothing a rejection could refuse: no verdict.
                        unreached.append(pair)
                        continue
                    if why:
                        failures[pair], jobs_of[pair] = "; ".join(why), job
            observed = set().union(*(_observed(lane, r) for lane in lanes.values()))
    finally:
        for lane in lanes.values():
            lane.close(r, redis_url)
    elapsed = time.monotonic() - started
    modes = sorted({m for p in points for m in matrix.modes_of(p)})
    matrix.REPORT.append(f"fault matrix: {len(points)} points, {len(modes)} modes, {ran} pairs run on "
                         f"{pool}/{store_kind}{' with lease_group_commit' if grouped else ''} "
          f"(rejections on {pool}/mysql), seed {seed}; settle bound {matrix.SETTLE_BOUND:g}s, settled in "
          f"{settle:.1f}s, {elapsed:.0f}s in all; {len(failures)} failing, {len(unreached)} not reached")
    if grouped:
        matrix.REPORT.append(f"  lease_group_commit on: {int(r.get(injector.BATCHED) or 0)} calls of a job "
                             "written in a batch shared with another job")
    for line in unsettled:
        matrix.REPORT.append(f"  not final within the settle bound: {line}")
    for pair in sorted(failures):
        matrix.REPORT.append(f"  FAIL {pair}: {failures[pair]} [job {jobs_of.get(pair, '-')}]")
    if os.environ.get("FAULTS_RECORD"):
        matrix.KNOWN_FAILING.with_suffix(f".{store_kind}.txt").write_text(
            "# Pairs of the fault matrix that fail on this commit: point, mode, the invariant broken.\n"
            "# The matrix xfails them strictly; remove a line when its fix lands.\n"
            + "".join(f"{pair}  # {why}\n" for pair, why in sorted(failures.items())))
    if os.environ.get("FAULTS_RECORD") == "points":
        offpath = [line for line in matrix.POINTS.read_text().splitlines() if line.startswith("offpath ")]
        listed = sorted(observed | set(points))
        matrix.POINTS.write_text(matrix.POINTS_HEADER + "".join(f"{p}\n" for p in listed)
                                 + "".join(f"{line}\n" for line in offpath))
    # Ordinals past the first may depend on timing; a (kind, verb) without any point is a new call.
    # The heartbeat and the reaper call on their own clocks, in whichever kind runs then: a point
    # of any kind covers their verb.
    # With lease_group_commit, a neighbour's fault fails a whole batch and every job in it then takes
    # its outage path, whatever its kind: which kind reaches which verb depends on how the batches
    # formed, so that run asks only for a point of every verb (the seed lane's run checks each kind).
    by_kind = {(p.kind, p.verb) for p in observed if p.verb not in matrix.PERIODIC_VERBS}
    missing = set() if grouped else by_kind - {(p.kind, p.verb) for p in points}
    missing |= {("any", p.verb) for p in observed} - {("any", p.verb) for p in all_points}
    assert not missing, f"calls the fault matrix has no point for (add them to points.txt): {sorted(missing)}"
    new = sorted(set(failures) - set(known) - flaky)
    fixed = sorted(set(known) - set(failures) - set(unreached) - flaky)
    assert not new, "pairs that break an invariant:\n" + "\n".join(f"{p}: {failures[p]}" for p in new)
    assert not fixed, ("pairs listed in known_failing.txt that pass now (remove them):\n"
                       + "\n".join(fixed))
