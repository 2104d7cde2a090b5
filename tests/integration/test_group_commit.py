"""lease_group_commit under a real worker (threads pool, Redis db 13, PostgreSQL store): the
completions of 200 short jobs share commits, and every job runs and completes exactly once.

A statement-level trigger (test-only SQL) on the jobs table counts the statements that complete
rows, as PostgreSQL runs them: each is one commit of its own (alone in autocommit, or a batch's
transaction), so fewer statements than jobs is fewer commits.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from celery_lease.store import COMPLETED
from tests.helpers import client_store, wait_for
from tests.owner_env import APP, OwnerEnv
from tests.workers import celery_processes, worker

pytestmark = pytest.mark.integration

JOBS = 200


def count_completing_statements(oenv: OwnerEnv) -> str:
    """Install the trigger; the table it writes one row to per statement that completes rows."""
    probe, jobs = f"{oenv.prefix}completing", oenv.store.t.jobs.name
    with oenv.store.begin() as c:
        c.execute(sa.text(f"CREATE TABLE {probe} (completed integer)"))
        c.execute(sa.text(
            f"CREATE FUNCTION {probe}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"INSERT INTO {probe} SELECT count(*) FROM new_rows n JOIN old_rows o ON o.id = n.id "
            f"WHERE n.status = 'completed' AND o.status IS DISTINCT FROM 'completed' HAVING count(*) > 0; "
            f"RETURN NULL; END $$"))
        c.execute(sa.text(
            f"CREATE TRIGGER {probe} AFTER UPDATE ON {jobs} REFERENCING OLD TABLE AS old_rows "
            f"NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {probe}()"))
    return probe


def run_jobs(oenv: OwnerEnv, tmp_path, probe: str, group_commit: bool) -> tuple[int, int]:
    """Run JOBS 10 ms jobs on a threads -c8 worker: (completing statements, rows they completed)."""
    app = oenv.app()
    client_store(app)  # this process publishes only; the worker keeps the app's bound
    j = oenv.store.t.jobs
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, oenv.env(lease_group_commit=group_commit), tmp_path, pool="threads",
                            concurrency=8))
        ids = [app.tasks["owner.sleeps"].delay(0.01).id for _ in range(JOBS)]

        def completed() -> int:
            with oenv.store.begin(read=True) as c:
                n = c.execute(sa.select(sa.func.count()).select_from(j).where(
                    j.c.id.in_(ids), j.c.status == COMPLETED)).scalar_one()
            return n == JOBS and n

        wait_for(completed, timeout=180, interval=0.2, message=f"not every job completed ({group_commit=})")
        log = procs[0].output()
    for job_id in ids:
        assert len(oenv.started(job_id)) == 1, job_id  # each body ran exactly once
    with oenv.store.begin() as c:
        statements, rows = c.execute(sa.text(
            f"SELECT count(*), coalesce(sum(completed), 0) FROM {probe}")).one()
        c.execute(sa.text(f"DELETE FROM {probe}"))
    assert "stale_completion_rejected" not in log and "completion rejected" not in log
    return int(statements), int(rows)


def test_completions_of_a_threads_worker_share_commits_and_each_job_completes_once(oenv, tmp_path):
    probe = count_completing_statements(oenv)
    try:
        alone = run_jobs(oenv, tmp_path, probe, group_commit=False)
        shared = run_jobs(oenv, tmp_path, probe, group_commit=True)
    finally:
        with oenv.store.begin() as c:
            c.execute(sa.text(f"DROP FUNCTION IF EXISTS {probe}() CASCADE"))
            c.execute(sa.text(f"DROP TABLE IF EXISTS {probe}"))
    assert alone == (JOBS, JOBS)  # setting off: one commit per completion
    statements, rows = shared
    assert rows == JOBS  # every job completed once, by one statement
    assert statements < JOBS, f"{statements} completing statements for {JOBS} jobs"  # some shared
