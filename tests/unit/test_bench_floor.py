"""The benchmarks' floors (bench/_floor.py): their statements are pinned, so a floor cannot get slower
unnoticed; the group floor's leader/follower queue is the library's (tests/unit/test_group.py); the
main-process floor's batches are one event-loop turn's writes."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
from kombu.asynchronous import get_event_loop, set_event_loop

from bench._floor import Floor, GroupFloor, MainFloor
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


class _Turns:
    """An event loop's call_soon queue, turned by hand (kombu's hub takes call_soon from any thread)."""

    def __init__(self) -> None:
        self.soon: list[Any] = []
        self.look: Any = lambda: None  # what a test reads at each hand-back
        self.looked: list[Any] = []

    def call_soon(self, callback: Any, *args: Any) -> None:
        self.looked.append(self.look())
        self.soon.append(lambda: callback(*args))

    def turn(self, count: int) -> None:
        """Run the first ``count`` callbacks handed back, waiting for them (the writer is a thread)."""
        wait_for(lambda: len(self.soon) >= count, message=f"{count} commits handed back")
        due, self.soon = self.soon[:count], self.soon[count:]
        for callback in due:
            callback()


@pytest.fixture
def loop():
    turns = _Turns()
    before = get_event_loop()
    set_event_loop(turns)
    yield turns
    set_event_loop(before)


def test_a_main_process_floor_shares_a_commit_among_writes_queued_during_one_and_hands_on_after_it(
        tmp_path, loop):
    url = f"sqlite:///{tmp_path / 'floor.db'}"
    main = MainFloor(GroupFloor(url, "m_"))
    main.floor.create()
    main.floor.claim("a", "tok-a")
    seen = traced(main.floor)
    reader = Floor(url, "m_")  # a connection of its own: it sees only what was committed
    everything = "SELECT id, token, done FROM m_floor ORDER BY id"
    loop.look = lambda: reader._connect().execute(everything).fetchall()
    handed: list[str] = []

    with main.floor._conn_lock:  # a commit in flight: the writer holds "d" and waits for the connection
        main.queue(("claim", ("d", "tok-d")), lambda: handed.append("d to the pool"))
        wait_for(lambda: not main.pending, message="the writer took the first write")
        main.queue(("claim", ("b", "tok-b")), lambda: handed.append("b to the pool"))
        main.queue(("complete", ("a", "tok-a")), lambda: handed.append("a acknowledged"))
        main.queue(("claim", ("c", "tok-c")), lambda: handed.append("c to the pool"))
    loop.turn(2)
    assert seen == [
        "BEGIN IMMEDIATE",
        "INSERT INTO m_floor (id, token, done) SELECT v.*, 0 FROM (VALUES ('d', 'tok-d')) AS v",
        "COMMIT",
        "BEGIN IMMEDIATE",
        "INSERT INTO m_floor (id, token, done) SELECT v.*, 0 FROM (VALUES ('b', 'tok-b'), ('c', 'tok-c'))"
        " AS v",
        "UPDATE m_floor SET done = 1 WHERE (id, token) IN (VALUES ('a', 'tok-a'))",
        "COMMIT",
    ]
    # Each commit is handed back to the loop once it is visible to others, then each write in the order queued
    assert loop.looked == [
        [("a", "tok-a", 0), ("d", "tok-d", 0)],
        [("a", "tok-a", 1), ("b", "tok-b", 0), ("c", "tok-c", 0), ("d", "tok-d", 0)],
    ]
    assert handed == ["d to the pool", "b to the pool", "a acknowledged", "c to the pool"]
    reader.close()
    main.floor.close()
