"""The app that real worker, beat and reaper subprocesses of the reaper tests run.

Configured from the environment: REAPER_BROKER (Redis db 7), REAPER_STORE, REAPER_PREFIX and
REAPER_CONF (JSON of extra settings). Fast settings: 2 s leases, 0.4 s heartbeats, 0.5 s grace,
owners stale after 2 s, the reaper every 0.5 s from beat on the ``reaper`` queue.

Every execution writes rows to ``<prefix>runs`` in the store's database (phase ``started`` /
``finished``), so a test counts executions even after it flushed the broker.

``python -m tests.apps.reaper_app`` runs the reaper loop in this process. With
REAPER_PAUSE_FILE set, the reaper writes the job id to that file after publishing a message
and then blocks before its CAS, so a test can SIGKILL it exactly there.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from celery import Celery, signals

from celery_lease import LeaseTask
from celery_lease.app_state import app_state
from celery_lease.reaper import run as reaper

DEFAULTS = {
    "REAPER_BROKER": "redis://127.0.0.1:6379/7",
    "REAPER_STORE": "sqlite:///reaper_app.sqlite3",
    "REAPER_PREFIX": "reaper_",
    "REAPER_CONF": "{}",
}
MAIN_OUTAGE = "main_outage"  # a runs row's phase: the main process's completion of that job fails once
SETTINGS = dict(
    lease_duration=2.0, lease_heartbeat_interval=0.4, lease_grace_period=0.5, lease_worker_stale_after=2.0,
    lease_reaper_hard_grace=5.0, lease_backoff_base=0.2, lease_backoff_max=1.0, lease_reaper_lock_ttl=3.0,
    lease_dispatch_timeout=30.0, lease_max_attempts=3,
    task_ignore_result=True, worker_prefetch_multiplier=1, worker_lost_wait=1.0,
    broker_connection_retry_on_startup=True,
    task_routes={"celery_lease.reap": {"queue": "reaper"}},
    beat_schedule={"lease-reaper": {"task": "celery_lease.reap", "schedule": 0.5, "options": {"expires": 5}}},
)


def runs_table(prefix: str) -> sa.Table:
    """The table every execution writes to (one row per phase)."""
    return sa.Table(
        f"{prefix}runs", sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
    )


def make_app(env: Mapping[str, str]) -> Celery:
    """The app from an environment (the test process builds its twin to send jobs)."""
    conf = {key: env.get(key, default) for key, default in DEFAULTS.items()}
    app = Celery("reaper_app", broker=conf["REAPER_BROKER"], set_as_current=False)
    app.conf.update(SETTINGS, lease_store_url=conf["REAPER_STORE"], lease_table_prefix=conf["REAPER_PREFIX"])
    app.conf.update(json.loads(conf["REAPER_CONF"]))
    runs = runs_table(conf["REAPER_PREFIX"])
    engine = sa.create_engine(conf["REAPER_STORE"], poolclass=sa.NullPool)

    def note(task: Any, phase: str) -> int:
        """Record a phase; returns how many times this job had started before."""
        with engine.begin() as c:
            before = c.execute(sa.select(sa.func.count()).select_from(runs).where(
                runs.c.job_id == task.request.id, runs.c.phase == "started")).scalar_one()
            c.execute(sa.insert(runs).values(job_id=task.request.id, phase=phase, attempt=task.lease.attempt,
                                             pid=os.getpid()))
        return before

    @app.task(base=LeaseTask, bind=True, shared=False, name="reaper_app.work")
    def work(self: Any, first: float, later: float = 0.1) -> int:
        """Holds its lease for ``first`` seconds on its first execution, ``later`` seconds afterwards."""
        runs_before = note(self, "started")
        threading.Event().wait(first if runs_before == 0 else later)
        note(self, "finished")
        return self.lease.attempt

    @app.task(base=LeaseTask, bind=True, shared=False, name="reaper_app.suicide")
    def suicide(self: Any) -> None:
        """Kills its own process on every attempt (SIGKILL: an OOM kill looks the same)."""
        note(self, "started")
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(base=LeaseTask, bind=True, shared=False, name="reaper_app.overrun", time_limit=1.0)
    def overrun(self: Any) -> None:
        """Outlives its hard time limit on every attempt."""
        note(self, "started")
        threading.Event().wait(30)

    @app.task(base=LeaseTask, bind=True, shared=False, name="reaper_app.raises_time_limit")
    def raises_time_limit(self: Any) -> None:
        """Raises TimeLimitExceeded itself (a sub-result's timeout passed on): a failure, not a time limit."""
        from celery.exceptions import TimeLimitExceeded

        note(self, "started")
        raise TimeLimitExceeded(5.0)

    @app.task(base=LeaseTask, bind=True, shared=False, name="reaper_app.boom")
    def boom(self: Any) -> None:
        """Raises on every attempt: a plain task failure."""
        note(self, "started")
        raise ValueError("boom")

    @app.task(base=LeaseTask, bind=True, shared=False, name="reaper_app.dies_after_success")
    def dies_after_success(self: Any, how: str = "_exit", main_outage: bool = False) -> str:
        """Returns while its completion finds the store away (deferred to the heartbeat); its process dies in
        task_postrun (``os._exit``, or ``sys.exit``, which billiard reports as SystemExit), after Celery
        stored SUCCESS and before that heartbeat. ``main_outage``: the main process's first completion of
        the job finds the store away too."""
        from celery_lease.errors import StoreUnavailable
        from celery_lease.store import for_app

        note(self, "started")
        if main_outage:
            note(self, MAIN_OUTAGE)
        jobs = for_app(self.app).jobs

        def unanswered(*args: Any, **kwargs: Any) -> bool:
            del jobs.complete  # once
            raise StoreUnavailable("no answer within the call bound (injected)")

        jobs.complete = unanswered
        return "done"

    def die_after_success(sender: Any = None, state: str | None = None, args: Any = (), **_: Any) -> None:
        if getattr(sender, "name", None) == "reaper_app.dies_after_success" and state == "SUCCESS":
            if args and args[0] == "sys.exit":
                sys.exit(1)
            os._exit(1)

    signals.task_postrun.connect(die_after_success, weak=False)

    def outage_in_main(**_: Any) -> None:
        """In the worker's main process: a job's completion fails once while its MAIN_OUTAGE row exists
        (the row taken by that failure), as a store that did not answer."""
        from celery_lease.errors import StoreUnavailable
        from celery_lease.store import for_app

        jobs = for_app(app, check=False).jobs
        complete, main = jobs.complete, os.getpid()

        def once_unanswered(job_id: str, *args: Any, **kwargs: Any) -> bool:
            if os.getpid() != main:  # a pool child forked later inherits this wrapper
                return complete(job_id, *args, **kwargs)
            with engine.begin() as c:
                taken = c.execute(sa.delete(runs).where(runs.c.job_id == job_id, runs.c.phase == MAIN_OUTAGE))
            if taken.rowcount:
                raise StoreUnavailable("no answer within the call bound (injected in the main process)")
            return complete(job_id, *args, **kwargs)

        jobs.complete = once_unanswered

    signals.worker_ready.connect(outage_in_main, weak=False)

    def timed_out(sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any) -> None:
        """In the worker's main process, once the lease has settled a hard time limit (Celery's failure
        handlers run after it, before billiard's kill): record whether the timed-out child still runs."""
        if getattr(sender, "app", None) is not app or type(exception).__name__ != "TimeLimitExceeded":
            return
        with engine.begin() as c:
            pids = c.execute(sa.select(runs.c.pid).where(runs.c.job_id == task_id,
                                                         runs.c.phase == "started")).scalars().all()
            phase = "timeout_alive" if any(map(_runs, pids)) else "timeout_dead"
            c.execute(sa.insert(runs).values(job_id=task_id, phase=phase, attempt=0, pid=os.getpid()))

    signals.task_failure.connect(timed_out, weak=False)
    return app


def _runs(pid: int) -> bool:
    """Whether process ``pid`` still runs code (a zombie awaiting its parent's wait does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


app = make_app(os.environ)


def _pause_forever(job_id: str) -> None:
    with open(os.environ["REAPER_PAUSE_FILE"], "w") as marker:
        marker.write(job_id)
    threading.Event().wait()


if __name__ == "__main__":
    if os.environ.get("REAPER_PAUSE_FILE"):
        app_state(app).after_publish = _pause_forever
    reaper.Reaper(app).run_forever(float(os.environ.get("REAPER_INTERVAL", "0.5")))
