"""The group commit of claims, completions and publish records (store/group.py, lease_group_commit): its
leader/follower queue, and a lone write that waits for nobody and writes what the single-row path writes.

What a batch writes on each database is in test_store_conformance.py.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading

import pytest
import sqlalchemy as sa

from celery_lease.config import load
from celery_lease.errors import StoreUnavailable
from celery_lease.store import ClaimTerms, JobStatements, Store
from celery_lease.store.group import Group, GroupedJobStatements, GroupedPublishStatements
from celery_lease.store.publishes import PublishStatements
from tests.helpers import wait_for

TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=5, takeover=True)


def test_a_lone_write_is_written_at_once_by_its_own_thread():
    writers: list[tuple[int, list]] = []

    def write(batch: list) -> list:
        writers.append((threading.get_ident(), batch))
        return ["ok"]

    group: Group[str, str] = Group(write)
    assert group.submit("a") == "ok"
    assert writers == [(threading.get_ident(), ["a"])]
    assert group.batches == 1 and not group._writing


def test_writes_arriving_during_a_commit_share_the_next_one_and_each_caller_gets_its_own_answer():
    release, first_started = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def write(batch: list[str]) -> list[str]:
        batches.append(batch)
        if len(batches) == 1:
            first_started.set()
            assert release.wait(10)
        return [f"{v}!" for v in batch]

    group: Group[str, str] = Group(write)
    answers: dict[str, str] = {}

    def submit(value: str) -> None:
        answers[value] = group.submit(value)

    leader = threading.Thread(target=submit, args=("lead",))
    leader.start()
    assert first_started.wait(10)
    followers = [threading.Thread(target=submit, args=(f"f{i}",)) for i in range(5)]
    for t in followers:
        t.start()
    wait_for(lambda: len(group._queue) == 5, timeout=10, message="the followers never queued")
    assert answers == {}  # nobody returns before the commit holding its write
    release.set()
    for t in [leader, *followers]:
        t.join(10)
    assert [len(b) for b in batches] == [1, 5]
    assert answers == {v: f"{v}!" for v in ["lead", *(f"f{i}" for i in range(5))]}
    assert group.batches == 2 and not group._writing


def test_a_failed_batch_raises_the_same_error_in_every_caller_and_the_next_batch_still_runs():
    release, first_started = threading.Event(), threading.Event()
    calls: list[list[str]] = []
    failure = StoreUnavailable("commit lost")

    def write(batch: list[str]) -> list[str]:
        calls.append(batch)
        if len(calls) == 1:
            first_started.set()
            assert release.wait(10)
        if len(calls) == 2:
            raise failure
        return batch

    group: Group[str, str] = Group(write)
    raised: dict[str, BaseException | None] = {}

    def submit(value: str) -> None:
        try:
            group.submit(value)
            raised[value] = None
        except StoreUnavailable as exc:
            raised[value] = exc

    threads = [threading.Thread(target=submit, args=("lead",))]
    threads[0].start()
    assert first_started.wait(10)
    threads += [threading.Thread(target=submit, args=(v,)) for v in ("a", "b", "c")]
    for t in threads[1:]:
        t.start()
    wait_for(lambda: len(group._queue) == 3, timeout=10, message="the followers never queued")
    release.set()
    for t in threads:
        t.join(10)
    assert raised == {"lead": None, "a": failure, "b": failure, "c": failure}
    assert group.submit("next") == "next"
    assert [sorted(c) for c in calls] == [["lead"], ["a", "b", "c"], ["next"]]


def test_an_interrupted_leader_raises_its_interrupt_and_its_followers_get_an_unknown_outcome():
    release, first_started = threading.Event(), threading.Event()
    calls: list[list[str]] = []

    def write(batch: list[str]) -> list[str]:
        calls.append(batch)
        if len(calls) == 1:
            first_started.set()
            assert release.wait(10)
            raise KeyboardInterrupt
        return batch

    group: Group[str, str] = Group(write)
    seen: dict[str, BaseException] = {}

    def submit(value: str) -> None:
        try:
            group.submit(value)
        except BaseException as exc:  # noqa: BLE001 - the test records what each caller got
            seen[value] = exc

    leader = threading.Thread(target=submit, args=("lead",))
    leader.start()
    assert first_started.wait(10)
    # A follower queued behind the interrupted leader leads the next batch and writes its own.
    follower = threading.Thread(target=submit, args=("after",))
    follower.start()
    wait_for(lambda: len(group._queue) == 1, timeout=10, message="the follower never queued")
    release.set()
    leader.join(10)
    follower.join(10)
    assert isinstance(seen.pop("lead"), KeyboardInterrupt)
    assert seen == {}
    assert calls == [["lead"], ["after"]] and not group._writing




def test_a_forked_child_writes_at_once_though_its_parent_was_writing_when_it_forked():
    # The child has no leader thread: a queue copied from the parent mid-commit would wait for ever.
    import os
    import signal

    release, started = threading.Event(), threading.Event()

    def write(batch: list[str]) -> list[str]:
        if batch == ["parent"]:
            started.set()
            assert release.wait(60)
        return [f"ok {v}" for v in batch]

    group: Group[str, str] = Group(write)
    leader = threading.Thread(target=group.submit, args=("parent",))
    leader.start()
    try:
        assert started.wait(10) and group._writing
        pid = os.fork()
        if pid == 0:  # the child: answered at once, or killed by the alarm
            signal.alarm(10)
            os._exit(0 if group.submit("child") == "ok child" and not group._writing else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        leader.join(10)
    assert group.batches == 1 and not group._writing


_GEVENT_CALLER_STOPPED = """
from gevent import monkey; monkey.patch_all()
import json, sys
import gevent, gevent.event
from celery_lease.store.group import Group

release = gevent.event.Event()

def write(batch):
    if batch == ["lead"]:
        release.wait()  # the leader's round trip, held until the follower is gone
    return [f"ok {v}" for v in batch]

group = Group(write)
answers = {}

def submit(name, limit=None):
    try:
        with gevent.Timeout(limit):
            answers[name] = group.submit(name)
    except BaseException as exc:
        answers[name] = type(exc).__name__

leader = gevent.spawn(submit, "lead")
while not group._writing:
    gevent.sleep(0)
stopped = gevent.spawn(submit, "stopped", 0.05 if sys.argv[1] == "timeout" else None)
while not group._queue:
    gevent.sleep(0)
if sys.argv[1] == "kill":
    gevent.kill(stopped)  # revoke(terminate=True) on a gevent pool
stopped.join()
release.set()
leader.join()
later = gevent.spawn(submit, "later", 10)
later.join()
print(json.dumps({"answers": answers, "writing": group._writing, "queued": len(group._queue)}))
"""


@pytest.mark.parametrize("how", ["timeout", "kill"])
def test_a_gevent_caller_stopped_while_it_waits_leaves_the_queue_and_later_writes_still_run(how):
    # Celery's hard time limit on a gevent pool is a gevent.Timeout raised where the greenlet waits, and a
    # terminating revoke kills it there: no shield holds either off. A lead handed to the gone caller
    # would be taken by nobody, and every later write of the process would wait for ever.
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _GEVENT_CALLER_STOPPED, how], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    stopped = {"timeout": "Timeout", "kill": "GreenletExit"}[how]
    assert outcome == {"answers": {"lead": "ok lead", "stopped": stopped, "later": "ok later"},
                       "writing": False, "queued": 0}


def test_a_leader_whose_lease_was_lost_while_it_waited_writes_its_neighbours_records(tmp_path):
    # The leader writes the batch in its own thread: a loss of its lease, deferred by the shield around
    # its record, lands on its own call when that ends, never on the neighbours' writes.
    import time
    import types
    import uuid

    from celery_lease.errors import LeaseLost
    from celery_lease.vocabulary import OnLost
    from celery_lease.worker.interrupt import ThreadInterrupter
    from celery_lease.worker.lease import Lease

    store = Store(f"sqlite:///{tmp_path / 'l.db'}", "gl_", group_commit=True)
    store.migrate()
    runtime = types.SimpleNamespace(store=store, worker="w1", interrupter=ThreadInterrupter)
    policy = types.SimpleNamespace(duration=60.0, on_lost=OnLost.RAISE)
    leases = {n: Lease(runtime, f"job-{n}", uuid.uuid4().hex, 1, policy, "", None, sent_at=time.monotonic())
              for n in "AB"}
    group = store.publishes.group
    write, release, started = group._write, threading.Event(), threading.Event()

    def held_first(batch: list) -> list:
        if not started.is_set():
            started.set()
            assert release.wait(10)
        return write(batch)

    group._write = held_first
    out: dict[str, object] = {}

    def record(name: str, lease: Lease | None) -> None:
        try:
            if lease is None:
                out[name] = store.publishes.record(f"pub-{name}", "t", None, None, 3)
            else:
                with lease.body():
                    out[name] = store.publishes.record(f"pub-{name}", "t", None, None, 3)
        except BaseException as exc:  # noqa: BLE001 - the test records what each caller got
            out[name] = exc

    try:
        callers = [threading.Thread(target=record, args=("first", None))]
        callers[0].start()
        assert started.wait(10)
        for n, (name, lease) in enumerate([("A", leases["A"]), ("B", leases["B"])], start=1):
            callers.append(threading.Thread(target=record, args=(name, lease)))
            callers[-1].start()
            wait_for(lambda n=n: len(group._queue) == n, timeout=10, message=f"{name} never queued")
        leases["A"].mark_lost("lost while its record waited for a shared commit")
        release.set()
        for t in callers:
            t.join(10)
        assert out["first"] == (True, "pub-first")
        assert out["B"] == (True, "pub-B"), out["B"]  # not job-A's LeaseLost
        assert isinstance(out["A"], LeaseLost) and out["A"].job_id == "job-A"
        assert {store.get(f"pub-{n}") is not None for n in ("first", "A", "B")} == {True}
    finally:
        store.engine.dispose()


def test_a_completion_batch_and_the_heartbeat_over_the_same_rows_lock_them_in_one_order(postgres_url):
    # Planners pick their own row order: an index scan locks in key order, a sequential or bitmap scan in
    # heap order. Two stores with opposite plans make both happen on a small table: the completion batch
    # holds X and waits for Z, while the heartbeat, in heap order, holds Y and would wait for Z as well;
    # once Z is free the batch needs Y. Locked in id order first, one simply waits for the other.
    from celery_lease.store.group import Completion

    prefix = f"g{secrets.token_hex(3)}_"
    plans = {"index": "-c enable_seqscan=off -c enable_bitmapscan=off",
             "heap": "-c enable_indexscan=off -c enable_bitmapscan=off -c enable_indexonlyscan=off"}
    url = sa.engine.make_url(postgres_url)
    batch_store = Store(url.update_query_dict({"options": plans["index"]}).render_as_string(False), prefix,
                        group_commit=True)
    beat_store = Store(url.update_query_dict({"options": plans["heap"]}).render_as_string(False), prefix)
    batch_store.migrate()
    j = batch_store.t.jobs
    ids = [f"job-{n:03d}" for n in range(40)]
    tokens = {job: secrets.token_hex(8) for job in ids}
    try:
        with batch_store.engine.begin() as c:
            for job in reversed(ids):  # heap order is the reverse of key order
                c.execute(sa.insert(j).values(
                    id=job, task_name="t", status="running", attempt_count=1, expired_count=0,
                    dispatch_count=0, max_attempts=3, available_at=0, created_at=0, updated_at=0,
                    started_at=0, lock_token=tokens[job], locked_by="w1", lease_duration=60.0,
                    lease_expires_at=10**10))
        x, z, y = ids[10], ids[20], ids[30]
        results: dict[str, object] = {}

        def run(name: str, call: object) -> None:
            try:
                results[name] = call()  # type: ignore[operator]
            except Exception as exc:  # noqa: BLE001 - the test records what each call got
                results[name] = exc

        def waiting() -> int:
            with batch_store.engine.connect() as c:
                return c.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                                         "'Lock' AND query LIKE :q"), {"q": f"%{prefix}jobs%"}).scalar_one()

        holder = batch_store.engine.connect()
        holder.execute(sa.select(j.c.id).where(j.c.id == z).with_for_update())
        batch = threading.Thread(target=run, args=("batch", lambda: batch_store.jobs.complete_many(
            [Completion(job, tokens[job], "w1", None) for job in (x, z, y)])))
        beat = threading.Thread(target=run, args=("beat", lambda: beat_store.jobs.beat(
            "w1", "h", 1, {tokens[job]: job for job in ids})))
        batch.start()
        wait_for(lambda: waiting() == 1, timeout=10, message="the completion batch never waited for Z")
        beat.start()
        wait_for(lambda: waiting() == 2, timeout=10, message="the heartbeat never waited")
        holder.rollback()
        holder.close()
        batch.join(30)
        beat.join(30)
        assert results["batch"] == {x, z, y}, results["batch"]
        assert isinstance(results["beat"], set), results["beat"]  # no deadlock on either side
    finally:
        batch_store.drop_schema()
        batch_store.dispose()
        beat_store.dispose()


# -- the store's completions ---------------------------------------------------------------
def traced_store(url: str, prefix: str, **settings: object) -> tuple[Store, list[str]]:
    """A store on SQLite and every statement its connections run, as the driver sees them."""
    store = Store(url, prefix, **settings)  # type: ignore[arg-type]
    seen: list[str] = []

    @sa.event.listens_for(store.engine, "connect")
    def trace(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        dbapi_conn.set_trace_callback(seen.append)

    store.engine.dispose()  # connections opened from now on are traced
    store.migrate()
    return store, seen


@pytest.mark.parametrize("kept", [None, '"value"'])
def test_a_lone_completion_waits_for_nobody_and_runs_the_statements_of_the_setting_off(tmp_path, kept):
    written: dict[bool, list[str]] = {}
    for on in (False, True):
        store, seen = traced_store(f"sqlite:///{tmp_path / f'{on}.db'}", "g_", group_commit=on)
        try:
            assert isinstance(store.jobs, GroupedJobStatements) is on
            store.publishes.record("lone", "t.task", "q", "{}", 5)
            assert store.jobs.claim("lone", "w1", "tok-lone", TERMS, "t.task", "q", lambda: None).claimed
            del seen[:]
            assert store.jobs.complete("lone", "tok-lone", "w1", kept) is True
            written[on] = list(seen)
            assert store.get("lone").status == "completed"
            assert store.jobs.kept_result("lone") == kept
            if on:
                assert store.jobs.group.batches == 1 and not store.jobs.group._writing
        finally:
            store.engine.dispose()
    assert written[True] == written[False]
    assert [s.split()[0] for s in written[True]] == ["BEGIN", "UPDATE", "COMMIT"]


def test_a_lone_claim_waits_for_nobody_and_runs_the_statements_of_the_setting_off(tmp_path):
    written: dict[bool, list[str]] = {}
    for on in (False, True):
        store, seen = traced_store(f"sqlite:///{tmp_path / f'c{on}.db'}", "g_", group_commit=on)
        try:
            for job in ("warm", "lone"):
                store.publishes.record(job, "t.task", "q", "{}", 5)
            # The statements' first build reads the schema: not measured.
            assert store.jobs.claim("warm", "w1", "tok-warm", TERMS, "t.task", "q", lambda: None).claimed
            del seen[:]
            claim = store.jobs.claim("lone", "w1", "tok-lone", TERMS, "t.task", "q", lambda: None)
            written[on] = list(seen)
            assert claim.claimed and claim.job is not None and claim.job.lock_token == "tok-lone"
            if on:
                assert store.jobs.claims.batches == 2 and not store.jobs.claims._writing
        finally:
            store.engine.dispose()
    assert written[True] == written[False]
    assert [s.split()[0] for s in written[True]] == ["BEGIN", "UPDATE", "COMMIT"]


@pytest.mark.parametrize("key", [None, "key-1"])
def test_a_lone_publish_record_waits_for_nobody_and_runs_the_statements_of_the_setting_off(tmp_path, key):
    written: dict[bool, list[str]] = {}
    for on in (False, True):
        store, seen = traced_store(f"sqlite:///{tmp_path / f'p{on}.db'}", "g_", group_commit=on)
        try:
            assert isinstance(store.publishes, GroupedPublishStatements) is on
            # The statements' first build reads the schema: not measured.
            store.publishes.record("warm", "t.task", "q", "{}", 5)
            del seen[:]
            assert store.publishes.record("lone", "t.task", "q", "{}", 5, key) == (True, "lone")
            written[on] = list(seen)
            assert store.get("lone").status == "pending"
            if on:
                # A keyed record never joins a batch; one without a key is a batch of one.
                group = store.publishes.group
                assert group.batches == (1 if key else 2) and not group._writing
        finally:
            store.engine.dispose()
    assert written[True] == written[False]
    inserts = ["INSERT"] * (3 if key else 2)  # the job, its key, its published event
    assert [s.split()[0] for s in written[True]] == ["BEGIN", *inserts, "COMMIT"]


def test_the_setting_reaches_the_store_and_is_off_by_default(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    assert Store.from_config(load({"lease_store_url": url})).group_commit is False
    assert type(Store(url).jobs) is JobStatements
    assert type(Store(url).publishes) is PublishStatements
    on = Store.from_config(load({"lease_store_url": url, "lease_group_commit": True}))
    assert on.group_commit is True and isinstance(on.jobs, GroupedJobStatements)
    assert isinstance(on.publishes, GroupedPublishStatements)
    # A database that cannot say which rows an UPDATE wrote keeps the single-row completion, and
    # (one decision for the setting) the single-row publish record.
    mysql = Store("mysql+pymysql://root@127.0.0.1:3306/test", group_commit=True)
    assert mysql.dialect.group_commit is False and type(mysql.jobs) is JobStatements
    assert type(mysql.publishes) is PublishStatements


def test_a_job_twice_in_one_batch_is_completed_once_and_its_second_write_goes_alone(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'd.db'}", "g_", group_commit=True)
    store.migrate()
    try:
        assert isinstance(store.jobs, GroupedJobStatements)
        toks = {}
        for job in ("a", "b"):
            store.publishes.record(job, "t.task", "q", "{}", 5)
            toks[job] = secrets.token_hex(8)
            assert store.jobs.claim(job, "w1", toks[job], TERMS, "t.task", "q", lambda: None).claimed
        from celery_lease.store.group import Completion

        batch = [Completion("a", toks["a"], "w1", None), Completion("b", toks["b"], "w1", None),
                 Completion("a", toks["a"], "w1", None)]
        assert store.jobs._write_batch(batch) == [True, True, None]
    finally:
        store.engine.dispose()


# -- a batch over one row another transaction holds ------------------------------------------
@pytest.mark.parametrize(("write", "audit"), [("claim", False), ("complete", False), ("complete", True),
                                              ("record", False)])
def test_a_row_another_transaction_holds_fails_only_its_own_write_and_its_batch_neighbours_land(
        postgres_url, write, audit):
    # A reaper batch or an operator's `lease requeue` holds one row FOR UPDATE (a record: the same id
    # inserted, uncommitted). The batch waits on it until the server gives up (lock_timeout), which rolls
    # the batch back: each caller then writes alone, as with the setting off, so that only the held row's
    # write fails (an outage for its caller, retried or deferred) and its neighbours' land once.
    from celery_lease.vocabulary import StoreFailure

    prefix = f"g{secrets.token_hex(3)}_"
    store = Store(postgres_url, prefix, call_timeout=2.0, group_commit=True, audit_every_transition=audit)
    store.migrate()
    holder_engine = sa.create_engine(postgres_url)
    held, free = "job-held", ["job-free-1", "job-free-2"]
    tokens = {job: secrets.token_hex(8) for job in ["lead", held, *free]}
    group = {"claim": store.jobs.claims, "complete": store.jobs.group, "record": store.publishes.group}[write]
    calls = {
        "claim": lambda job: store.jobs.claim(job, "w1", tokens[job], TERMS, "t", "q", lambda: None).claimed,
        "complete": lambda job: store.jobs.complete(job, tokens[job], "w1"),
        "record": lambda job: store.publishes.record(job, "t.task", "q", "{}", 5)}[write]
    try:
        for job in tokens:
            if write != "record" or job == "lead":
                store.publishes.record(job, "t.task", "q", "{}", 5)
            if write == "complete":
                assert store.jobs.claim(job, "w1", tokens[job], TERMS, "t.task", "q", lambda: None).claimed
        holder = holder_engine.connect()
        j = store.t.jobs
        if write == "record":  # "lead" exists: its record is answered as alone, (False, "lead")
            holder.execute(sa.insert(j).values(
                id=held, task_name="t", status="pending", attempt_count=0, expired_count=0, dispatch_count=0,
                max_attempts=3, available_at=0, created_at=0, updated_at=0))
        else:
            holder.execute(sa.select(j.c.id).where(j.c.id == held).with_for_update())
        batches: list[int] = []
        inner, release, started = group._write, threading.Event(), threading.Event()

        def held_first(batch: list) -> list:
            batches.append(len(batch))
            if not started.is_set():
                started.set()
                assert release.wait(10)
            return inner(batch)

        group._write = held_first
        out: dict[str, object] = {}

        def call(job: str) -> None:
            try:
                out[job] = calls(job)
            except StoreUnavailable as exc:
                out[job] = exc

        threads = [threading.Thread(target=call, args=("lead",))]
        threads[0].start()
        assert started.wait(10)
        for n, job in enumerate([held, *free], start=1):
            threads.append(threading.Thread(target=call, args=(job,)))
            threads[-1].start()
            wait_for(lambda n=n: len(group._queue) == n, timeout=10, message=f"{job} never queued")
        release.set()
        for t in threads:
            t.join(30)
        holder.rollback()
        holder.close()

        assert batches == [1, 3]  # the held row and its neighbours were one batch
        failed = out.pop(held)
        assert isinstance(failed, StoreUnavailable) and failed.kind == StoreFailure.TIMEOUT, failed
        landed = {"claim": True, "complete": True, "record": None}[write]
        for job in free:
            assert out[job] == (landed if landed is not None else (True, job)), out[job]
        rows = {job: store.get(job) for job in [held, *free]}
        if write == "claim":  # each neighbour claimed once, under its own token; the held row untouched
            assert [(r.status, r.lock_token, r.attempt_count) for r in (rows[f] for f in free)] == [
                ("running", tokens[f], 1) for f in free]
            h = rows[held]
            assert (h.status, h.lock_token, h.attempt_count) == ("pending", None, 0)
        elif write == "complete":  # the held row's completion deferred, not lost: still running, its token
            assert [rows[f].status for f in free] == ["completed", "completed"]
            assert (rows[held].status, rows[held].lock_token) == ("running", tokens[held])
        else:  # the uncommitted insert rolled back: the held id's record is retried by its caller
            assert rows[held] is None and [rows[f].status for f in free] == ["pending", "pending"]
    finally:
        store.drop_schema()
        store.dispose()
        holder_engine.dispose()


@pytest.mark.parametrize(("kind", "single_writer", "alone"), [
    ("timeout", False, True),  # the server gave up on a row lock: rolled back, each written alone
    ("unreachable", False, False),  # a lost connection or the client's deadline: its commit may have landed
    ("pool", False, False),
    ("timeout", True, False),  # SQLite's lock is the whole file: each alone would wait for it again
])
def test_only_a_batch_the_server_gave_up_on_is_written_again_alone(kind, single_writer, alone):
    import types

    from celery_lease.store.group import Completion, _answers
    from celery_lease.vocabulary import StoreFailure

    failure = StoreUnavailable("batch failed", kind=StoreFailure(kind))
    db = types.SimpleNamespace(dialect=types.SimpleNamespace(single_writer=single_writer))

    def many(rows: list) -> dict:
        raise failure

    batch = [Completion(job, "tok", "w1", None) for job in ("a", "b")]
    if alone:
        assert _answers(batch, lambda c: True, many, lambda done: done, db) == [None, None]  # type: ignore[arg-type]
    else:
        with pytest.raises(StoreUnavailable) as raised:
            _answers(batch, lambda c: True, many, lambda done: done, db)  # type: ignore[arg-type]
        assert raised.value is failure


def test_on_sqlite_a_batch_meeting_the_held_file_fails_each_caller_once_as_each_write_alone_would(tmp_path):
    # SQLite has no row lock: a writer holds the whole file, so the single-row path fails as well (the bug
    # of a batch failing its neighbours does not exist there) and the batch's failure is not retried alone.
    from celery_lease.store.group import Completion
    from celery_lease.vocabulary import StoreFailure

    path = tmp_path / "h.db"
    store = Store(f"sqlite:///{path}", "g_", call_timeout=1.0, group_commit=True)
    store.migrate()
    toks = {}
    for job in ("a", "b"):
        store.publishes.record(job, "t.task", "q", "{}", 5)
        toks[job] = secrets.token_hex(8)
        assert store.jobs.claim(job, "w1", toks[job], TERMS, "t.task", "q", lambda: None).claimed
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        batch = [Completion(job, toks[job], "w1", None) for job in ("a", "b")]
        with pytest.raises(StoreUnavailable) as raised:
            store.jobs._write_batch(batch)
        assert raised.value.kind == StoreFailure.TIMEOUT
        with pytest.raises(StoreUnavailable) as alone:
            JobStatements.complete(store.jobs, "a", toks["a"], "w1")
        assert alone.value.kind == StoreFailure.TIMEOUT
        holder.execute("ROLLBACK")
        assert [store.get(job).status for job in ("a", "b")] == ["running", "running"]
    finally:
        holder.close()
        store.engine.dispose()
