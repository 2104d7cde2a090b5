"""The fault matrix's injector: the object ``lease_fault_injector`` names in tests/apps/faults_app.py.

The store hands it each engine it builds (``engine_built``): the injector wraps the pool's
driver connections, so every statement of the store, on SQLAlchemy's execution layer or on the
driver connection the hot transitions use, passes it. The library's result-backend calls pass
``backend_call``. A call belongs to the store's public method (the *verb*: the engine's own, or a
statement group's, such as ``store.jobs.claim``) that made it, found on the stack, and to the job
named by that method's ``job_id`` (or ``leases``) argument; the n-th call of a verb for a job is
its *ordinal*, counted in Redis across the worker processes. A batch that a group commit's leader
writes for many jobs (lease_group_commit, BATCHES) is a call of the single verb for each of them.

A job's scenario (``faults:scenario:<job>``: kind, verb, ordinal, mode) says where its one fault
goes; each fault fires at most once per job (``faults:fired:<job>`` records where it fired).
Modes raise what the driver really raises; see MODES.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import redis
import sqlalchemy as sa

import celery_lease.store as stores
from celery_lease.store import Store

#: The modes of a store call, and those of a result-backend call.
STORE_MODES = ("before", "pool_timeout", "lost_after_commit", "vanished")
REJECT_MODES = ("rejected_data", "rejected_constraint")
BACKEND_MODES = ("backend_once", "backend_while")
MODES = STORE_MODES + REJECT_MODES + BACKEND_MODES
#: Seconds a backend that refuses "for a while" keeps refusing.
BACKEND_OUTAGE = 3.0
REFUSED = "Error 111 connecting to 127.0.0.1:6379. Connection refused."

#: The store's classes: the engine's calls (on Store) and those of each statement group.
STORE_CLASSES = (Store, *(getattr(stores, name) for name in stores.__all__ if name.endswith("Statements")))
VERBS = frozenset(n for cls in STORE_CLASSES for n in dir(cls)
                  if not n.startswith("_") and callable(getattr(cls, n)))
#: A group commit's batch writes (lease_group_commit): the single verb each is a call of per job, the
#: argument holding the batch's rows and a row's job id attribute.
BATCHES = {"claim_many": ("claim", "rows", "job_id"), "complete_many": ("complete", "rows", "job_id"),
           "record_many": ("record", "jobs", "id")}
BATCHED = "faults:batched"  # how many calls of a job the matrix's batches made
_STORE_DIR = os.path.dirname(sys.modules[Store.__module__].__file__ or "")
_PING = "SELECT 1"


def _reads_only(statement: str) -> bool:
    head = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else ""
    return head in {"SELECT", "BEGIN", "SET", "SAVEPOINT", "RELEASE", "SHOW", "PRAGMA"}


class _Call:
    """One call of a store verb on one thread: its frame, verb, and the jobs it is a call of (one; or
    every job of a batch that a group commit's leader writes), each with its scenario and ordinal."""

    def __init__(self, frame: Any, verb: str, jobs: list[tuple[str, dict | None, int]]) -> None:
        self.frame, self.verb, self.jobs = frame, verb, jobs
        self.vanished = False

    def target(self, *modes: str) -> tuple[str, dict, str] | None:
        """The job whose scenario fails this call in one of ``modes``: (job, scenario, "verb#ordinal")."""
        for job, s, ordinal in self.jobs:
            if s and s["mode"] in modes and s["verb"] == self.verb and s["ordinal"] == ordinal:
                return job, s, f"{self.verb}#{ordinal}"
        return None


class Injector:
    """Fails the one store or backend call each scenario names, as its driver would."""

    def __init__(self) -> None:
        self._redis: redis.Redis | None = None
        self._scenarios: dict[str, dict | None] = {}
        self._local = threading.local()
        self._deleters: dict[str, sa.Engine] = {}

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None or getattr(self, "_pid", None) != os.getpid():
            self._redis = redis.Redis.from_url(os.environ["FAULTS_REDIS"])
            self._pid = os.getpid()
        return self._redis

    # -- the seam ------------------------------------------------------------------------
    def engine_built(self, engine: sa.Engine, store: Any) -> None:
        """Wrap every driver connection ``engine``'s pool makes."""
        create = engine.pool._invoke_creator

        def creator(record: Any) -> Any:
            return _Connection(create(record), self, store)

        engine.pool._invoke_creator = creator
        sa.event.listen(engine.pool, "checkout", self._checkout)
        # The driver's own code (psycopg's type lookups, the store's autocommit writes) gets the
        # driver's connection; statements still go through the wrapper's cursors.
        driver_of = engine.dialect.get_driver_connection
        engine.dialect.get_driver_connection = (  # type: ignore[method-assign]
            lambda conn: driver_of(conn._real if isinstance(conn, _Connection) else conn))

    def _checkout(self, _dbapi: Any, _record: Any, _proxy: Any) -> None:
        """The pool hands out no connection within its timeout: what QueuePool raises."""
        call = self.call()
        hit = call.target("pool_timeout") if call is not None else None
        if hit is not None and self._fire(hit[0], hit[2]):
            raise sa.exc.TimeoutError("QueuePool limit of size 6 overflow 0 reached, connection timed out, "
                                      "timeout 1.00 (Background on this error at: https://sqlalche.me/e/20/3o7r)")

    def backend_call(self, verb: str, task_id: str) -> None:
        scenario = self._scenario(task_id)
        if scenario is None:
            return
        ordinal = int(self.redis.incr(f"faults:calls:{task_id}:{verb}"))
        if scenario["mode"] == "clean":
            self.redis.rpush(f"faults:seen:{task_id}", f"{verb}#{ordinal}")
            return
        if scenario["verb"] != verb:
            return
        outage = f"faults:outage:{task_id}"
        if scenario["mode"] == "backend_while" and (
                self.redis.exists(outage) or (ordinal == scenario["ordinal"] and self._fire(task_id, verb))):
            self.redis.set(outage, 1, px=int(BACKEND_OUTAGE * 1000), nx=True)
            raise redis.exceptions.ConnectionError(REFUSED)
        once = scenario["mode"] == "backend_once" and ordinal == scenario["ordinal"]
        if once and self._fire(task_id, verb):
            raise redis.exceptions.ConnectionError(REFUSED)

    # -- bookkeeping ---------------------------------------------------------------------
    def _scenario(self, job_id: Any) -> dict | None:
        if not isinstance(job_id, str):
            return None
        if job_id not in self._scenarios:
            raw = self.redis.get(f"faults:scenario:{job_id}")
            self._scenarios[job_id] = json.loads(raw) if raw else None
        return self._scenarios[job_id]

    def _fire(self, job_id: str, where: str) -> bool:
        return bool(self.redis.set(f"faults:fired:{job_id}", where, nx=True))

    def call(self) -> _Call | None:
        """The store call this thread is in (the outermost store verb on the stack), counted once."""
        frame, found, batch = sys._getframe(2), None, None
        while frame is not None:
            code = frame.f_code
            if code.co_name in VERBS and os.path.dirname(code.co_filename) == _STORE_DIR:
                found = frame
            if code.co_name in BATCHES and os.path.dirname(code.co_filename) == _STORE_DIR and batch is None:
                batch = frame
            frame = frame.f_back
        if found is None:
            return None
        if batch is not None:
            found = batch
        current: _Call | None = getattr(self._local, "call", None)
        if current is not None and current.frame is found:
            return current
        if batch is not None:
            # A group commit's leader writes for every job of the batch: its statements are a call of
            # the single verb for each of them (their complete#n), and a fault of any one fails it.
            verb, rows, id_of = BATCHES[batch.f_code.co_name]
            jobs = [(job, scenario, self._count(job, verb, scenario))
                    for job in dict.fromkeys(getattr(row, id_of) for row in batch.f_locals[rows])
                    if (scenario := self._scenario(job)) is not None]
            self.redis.incr(BATCHED, len(jobs))
            self._local.call = _Call(found, verb, jobs)
            return self._local.call
        verb, loc = found.f_code.co_name, found.f_locals
        job, scenario = None, None
        candidates = [loc.get("job_id")]
        if isinstance(loc.get("leases"), Mapping):
            candidates += list(loc["leases"].values())  # token -> job id
        job_obj = loc.get("job")
        if job_obj is not None and hasattr(job_obj, "id"):
            candidates.append(job_obj.id)
        if not any(isinstance(c, str) for c in candidates):  # release_lock(resource, token), ...
            from celery import current_task

            request = getattr(current_task, "request", None)
            candidates.append(getattr(request, "id", None))
        for candidate in candidates:
            found_scenario = self._scenario(candidate)
            if found_scenario is not None and (scenario is None or found_scenario["verb"] == verb):
                job, scenario = candidate, found_scenario
        jobs = [(job, scenario, self._count(job, verb, scenario))] if job is not None and scenario else []
        self._local.call = _Call(found, verb, jobs)
        return self._local.call

    def _count(self, job: str, verb: str, scenario: dict) -> int:
        """The ordinal of this call of ``verb`` for ``job`` (a clean run records it as seen)."""
        ordinal = int(self.redis.incr(f"faults:calls:{job}:{verb}"))
        if scenario["mode"] == "clean":
            self.redis.rpush(f"faults:seen:{job}", f"{verb}#{ordinal}")
        return ordinal

    # -- the faults ----------------------------------------------------------------------
    def before_execute(self, conn: _Connection, statement: str) -> None:
        if statement.strip() == _PING:
            return
        call = self.call()
        if call is None or not call.jobs:
            return
        if (hit := call.target("vanished")) and not call.vanished and self._fire(hit[0], hit[2]):
            call.vanished = True
            self._delete_row(conn.store, hit[0])
        elif (hit := call.target("before")) and self._fire(hit[0], hit[2]):
            raise _unreachable(conn)
        elif ((hit := call.target(*REJECT_MODES)) and not _reads_only(statement)
              and self._fire(hit[0], hit[2])):
            raise _rejected(conn, hit[1]["mode"])

    def lost_after(self, conn: _Connection, autocommit: bool) -> bool:
        """Whether the answer of what just committed (a commit, or an autocommit statement) is lost."""
        call = self.call()
        hit = call.target("lost_after_commit") if call is not None else None
        return bool(hit is not None and self._fire(hit[0], hit[2]))

    def _delete_row(self, store: Any, job_id: str) -> None:
        engine = self._deleters.get(store.url)
        if engine is None:
            engine = self._deleters[store.url] = sa.create_engine(store.url, poolclass=sa.NullPool)
        with engine.begin() as c:
            c.execute(sa.delete(store.t.jobs).where(store.t.jobs.c.id == job_id))


def _family(conn: _Connection) -> str:
    return type(conn._real).__module__.split(".")[0]


def _unreachable(conn: _Connection) -> Exception:
    """What the driver raises when the server is gone (SQLite: its file lock never came free)."""
    family = _family(conn)
    if family == "sqlite3":
        import sqlite3

        return sqlite3.OperationalError("database is locked")
    if family == "pymysql":
        import pymysql

        return pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query")
    import psycopg

    return psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly")


def _rejected(conn: _Connection, mode: str) -> Exception:
    import pymysql

    if mode == "rejected_data":
        return pymysql.err.DataError(1406, "Data too long for column 'error' at row 1")
    return pymysql.err.IntegrityError(1452, "Cannot add or update a child row: a foreign key constraint "
                                            "fails")


class _Cursor:
    def __init__(self, real: Any, conn: _Connection) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_conn", conn)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)

    def __iter__(self) -> Any:
        return iter(self._real)

    def _run(self, method: str, statement: str, *args: Any, **kwargs: Any) -> Any:
        conn = self._conn
        conn.injector.before_execute(conn, statement)
        answer = getattr(self._real, method)(statement, *args, **kwargs)
        if conn.autocommitting() and not _reads_only(statement) and conn.injector.lost_after(conn, True):
            conn.drop()
        return answer

    def execute(self, statement: str, *args: Any, **kwargs: Any) -> Any:
        return self._run("execute", statement, *args, **kwargs)

    def executemany(self, statement: str, *args: Any, **kwargs: Any) -> Any:
        return self._run("executemany", statement, *args, **kwargs)


class _Connection:
    """A driver connection whose statements and commits pass the injector."""

    def __init__(self, real: Any, injector: Injector, store: Any) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "injector", injector)
        object.__setattr__(self, "store", store)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)

    def cursor(self, *args: Any, **kwargs: Any) -> _Cursor:
        return _Cursor(self._real.cursor(*args, **kwargs), self)

    def autocommitting(self) -> bool:
        """Whether the statement just run was committed on its own (no transaction is open now)."""
        real = self._real
        if _family(self) == "sqlite3":
            return not real.in_transaction
        if _family(self) == "pymysql":
            return bool(real.get_autocommit()) and not real.server_status & 1  # SERVER_STATUS_IN_TRANS
        import psycopg

        return bool(real.autocommit) and real.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    def commit(self) -> None:
        self._real.commit()
        if self.injector.lost_after(self, False):
            self.drop()

    def drop(self) -> None:
        """The server committed; the answer is lost as when the connection drops (the pool
        discards a connection whose error reads as a disconnect)."""
        exc = _unreachable(self)
        if _family(self) == "sqlite3":
            import sqlite3

            exc = sqlite3.OperationalError("disk I/O error")
        raise exc


INJECTOR = Injector()
