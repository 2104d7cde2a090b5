"""The demo's own count of executions, written by the tasks themselves.

Each run of a task body is a row in ``executions.sqlite3`` (run directory): when it
started, on which worker, which phase it reached and how it ended. The demo's final
table counts executions from here, not from the library it is judging, and the same
rows exist in both modes. An app of your own has no need for this module.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from celery import signals

from . import localdb
from .settings import RUN_DIR

__all__ = ["Execution", "execution", "rows", "phases", "nodes"]

PATH = RUN_DIR / "executions.sqlite3"
SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    id INTEGER PRIMARY KEY, job_id TEXT, label TEXT, task TEXT, node TEXT, pid INTEGER,
    token TEXT, attempt INTEGER, started_at REAL, phase TEXT, phase_at REAL,
    finished_at REAL, outcome TEXT
);
CREATE TABLE IF NOT EXISTS phases (execution_id INTEGER, phase TEXT, at REAL);
CREATE TABLE IF NOT EXISTS nodes (node TEXT, pid INTEGER, ready_at REAL);
"""
FINISHED = "finished"


class Execution:
    """One run of a task body; ``phase`` records how far it got."""

    def __init__(self, row_id: int) -> None:
        self.row_id = row_id

    def phase(self, name: str) -> None:
        now = time.time()
        with localdb.connect(PATH, SCHEMA) as conn:
            conn.execute("UPDATE executions SET phase = ?, phase_at = ? WHERE id = ?",
                         (name, now, self.row_id))
            conn.execute("INSERT INTO phases (execution_id, phase, at) VALUES (?, ?, ?)",
                         (self.row_id, name, now))


@contextlib.contextmanager
def execution(task: Any, label: str) -> Iterator[Execution]:
    """Record one run of ``task``'s body for the business object ``label``."""
    lease = task.lease
    request = task.request
    node = (request.hostname or "").split("@")[0]
    with localdb.connect(PATH, SCHEMA) as conn:
        cur = conn.execute(
            "INSERT INTO executions (job_id, label, task, node, pid, token, attempt, started_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (request.id, label, task.name.rsplit(".", 1)[-1], node, os.getpid(),
             (lease.token or "")[:8], lease.attempt, time.time()),
        )
        run = Execution(int(cur.lastrowid))
    outcome = FINISHED
    try:
        yield run
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        with localdb.connect(PATH, SCHEMA) as conn:
            conn.execute("UPDATE executions SET finished_at = ?, outcome = ? WHERE id = ?",
                         (time.time(), outcome, run.row_id))


def rows() -> list[dict[str, Any]]:
    """Every execution, oldest first."""
    with localdb.connect(PATH, SCHEMA) as conn:
        return [dict(r) for r in conn.execute("SELECT * FROM executions ORDER BY id")]


def phases() -> list[dict[str, Any]]:
    """Every phase reached, with its execution's id, oldest first."""
    with localdb.connect(PATH, SCHEMA) as conn:
        return [dict(r) for r in conn.execute("SELECT * FROM phases ORDER BY at")]


def nodes() -> dict[str, int]:
    """Worker node name -> main process pid, for the workers that reported ready."""
    with localdb.connect(PATH, SCHEMA) as conn:
        return {r["node"]: r["pid"] for r in conn.execute("SELECT node, pid FROM nodes ORDER BY ready_at")}


@signals.worker_ready.connect
def _worker_ready(sender: Any = None, **_: Any) -> None:
    if getattr(getattr(sender, "app", None), "main", None) != "example_project":
        return  # another app's worker in this process
    node = (getattr(sender, "hostname", "") or "").split("@")[0]
    with localdb.connect(PATH, SCHEMA) as conn:
        conn.execute("INSERT INTO nodes (node, pid, ready_at) VALUES (?, ?, ?)",
                     (node, os.getpid(), time.time()))
