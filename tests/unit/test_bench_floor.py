"""The benchmarks' floors (bench/_floor.py): their statements are pinned, so a floor cannot get slower
unnoticed, and the group floor shares one commit among the writes due at the same moment."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from bench._floor import Floor, Group, GroupFloor
from tests.helpers import wait_for


def traced(floor: Floor) -> list[str]:
    """The statements SQLite runs for ``floor`` from now on, as the driver sees them."""
    seen: list[str] = []
    conn = floor._connect()
    assert isinstance(conn, sqlite3.Connection)
    conn.set_trace_callback(seen.append)
    return seen


@pytest.fixture
def floor(tmp_path):
    f = Floor(f"sqlite:///{tmp_path / 'floor.db'}", "f_")
    f.create()
    yield f
    f.close()


def test_the_one_commit_floor_writes_one_statement_per_write_each_in_its_own_durable_commit(floor):
    seen = traced(floor)
    floor.record("job-1", "{}")
    floor.claim("job-2", "tok")
    floor.complete("job-2", "tok")
    assert seen == [
        "BEGIN IMMEDIATE", "INSERT INTO f_floor (id, payload, done) VALUES ('job-1', '{}', 0)", "COMMIT",
        "BEGIN IMMEDIATE", "INSERT INTO f_floor (id, token, done) VALUES ('job-2', 'tok', 0)", "COMMIT",
        "BEGIN IMMEDIATE", "UPDATE f_floor SET done = 1 WHERE id = 'job-2' AND token = 'tok'", "COMMIT",
    ]
    assert floor._connect().execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_group_floor_batch_is_one_statement_per_kind_in_one_commit_fenced_row_by_row(tmp_path):
    group = GroupFloor(f"sqlite:///{tmp_path / 'floor.db'}", "g_")
    group.create()
    group.claim("a", "tok-a")
    seen = traced(group)
    group._write([("claim", ("b", "tok-b")), ("claim", ("c", "tok-c")), ("complete", ("a", "tok-a")),
                  ("complete", ("b", "wrong"))])
    assert seen == [
        "BEGIN IMMEDIATE",
        "INSERT INTO g_floor (id, token, done) SELECT v.*, 0 FROM (VALUES ('b', 'tok-b'), ('c', 'tok-c'))"
        " AS v",
        "UPDATE g_floor SET done = 1 WHERE (id, token) IN (VALUES ('a', 'tok-a'), ('b', 'wrong'))",
        "COMMIT",
    ]
    rows = dict(group._connect().execute("SELECT id, done FROM g_floor").fetchall())
    assert rows == {"a": 1, "b": 0, "c": 0}  # b's write carried another token: b alone is not completed
    group.close()


def test_a_lone_write_is_committed_at_once_by_its_own_thread():
    writers: list[tuple[int, list]] = []
    group = Group(lambda batch: writers.append((threading.get_ident(), batch)))
    group.submit("claim", ("a", "t"))
    assert writers == [(threading.get_ident(), [("claim", ("a", "t"))])]


def test_writes_arriving_during_a_commit_share_the_next_one_and_each_caller_returns_after_its_own():
    release, first_started = threading.Event(), threading.Event()
    batches: list[list] = []

    def write(batch: list) -> None:
        batches.append(batch)
        if len(batches) == 1:
            first_started.set()
            assert release.wait(10)

    group = Group(write)
    returned: list[str] = []

    def submit(job: str) -> None:
        group.submit("claim", (job, "t"))
        returned.append(job)

    leader = threading.Thread(target=submit, args=("lead",))
    leader.start()
    assert first_started.wait(10)
    followers = [threading.Thread(target=submit, args=(f"f{i}",)) for i in range(5)]
    for t in followers:
        t.start()
    wait_for(lambda: len(group._queue) == 5, timeout=10, message="the followers never queued")
    assert returned == []  # nobody returns before the commit holding its write
    release.set()
    for t in [leader, *followers]:
        t.join(10)
    assert [len(b) for b in batches] == [1, 5]
    assert sorted(returned) == sorted(["lead", *(f"f{i}" for i in range(5))])
    assert group.batches == 2


def test_a_failed_commit_raises_in_every_caller_of_its_batch_and_the_next_batch_still_runs():
    calls: list[int] = []

    def write(batch: list) -> None:
        calls.append(len(batch))
        if len(calls) == 1:
            raise OSError("disk full")

    group = Group(write)
    with pytest.raises(OSError, match="disk full"):
        group.submit("claim", ("a", "t"))
    group.submit("claim", ("b", "t"))
    assert calls == [1, 1] and group.batches == 1
