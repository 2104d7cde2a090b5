"""`celery -A tests.apps.ops_app lease ...` through Celery's own command, on SQLite and PostgreSQL.

Read-only verbs share one populated store per module and store kind (the scene of
``tests.apps.ops_app.populate``); verbs that change rows get a fresh scene each and a
real Redis broker (db 10) whose queues show the re-published messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery.bin.celery import celery
from click.testing import CliRunner, Result

from celery_lease.app_state import app_state
from celery_lease.store import for_app, migrations
from tests.apps import ops_app
from tests.conftest import SCENE_STORES, flushed_redis, require_service, service_url, unique_prefix

REDIS_DB = 10
VERBS = ("migrate", "status", "jobs", "inspect", "events", "reap", "requeue", "dlq", "effects", "check",
         "tune", "exporter", "web")


@dataclasses.dataclass
class Scene:
    app: Any
    store: Any
    ids: dict[str, list[str]]

    def run(self, *args: str) -> Result:
        return CliRunner().invoke(celery, ["-A", "tests.apps.ops_app", "lease", *args])

    def run_input(self, text: str, *args: str) -> Result:
        """Run with ``text`` as what the operator types."""
        return CliRunner().invoke(celery, ["-A", "tests.apps.ops_app", "lease", *args], input=text)

    def json(self, *args: str) -> Any:
        result = self.run(*args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)


@contextlib.contextmanager
def scene(url: str, broker: str) -> Iterator[Scene]:
    """A populated store under a fresh prefix, with the CLI's app pointed at it."""
    prefix = unique_prefix()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPS_STORE", url)
        mp.setenv("OPS_PREFIX", prefix)
        mp.setenv("OPS_BROKER", broker)
        app = ops_app.app
        # The store the commands find cached on the app: an operator's, with the long call bound
        # (`celery lease` builds it so), not a worker's third of the test's 1 s lease.
        store = for_app(app, check=False, operator=True)
        store.migrate()
        try:
            ids = ops_app.populate(store)
            yield Scene(app, store, ids)
        finally:
            store.drop_schema()
            store.engine.dispose()


def _url(kind: str, tmp_path_factory: Any) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('ops') / 'lease.sqlite3'}"
    return require_service("PostgreSQL", service_url("postgres"))


@pytest.fixture(scope="module", params=SCENE_STORES)
def ro(request, tmp_path_factory) -> Iterator[Scene]:
    """One populated store per store kind that the read-only tests share (they change nothing)."""
    with scene(_url(request.param, tmp_path_factory), "memory://") as s:
        yield s


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    with flushed_redis(require_service("Redis", service_url("redis")), REDIS_DB) as (_, client):
        yield client


@pytest.fixture(params=SCENE_STORES)
def rw(request, tmp_path_factory, broker) -> Iterator[Scene]:
    """A fresh populated store per test, publishing to Redis db 10."""
    broker_url = urlunsplit(urlsplit(service_url("redis"))._replace(path=f"/{REDIS_DB}"))
    with scene(_url(request.param, tmp_path_factory), broker_url) as s:
        yield s


def queued_ids(client: redis.Redis, queue: str) -> list[str]:
    """Task ids of the messages waiting in a Redis queue (kombu's list named after the queue)."""
    return [json.loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)]


# -- the command itself -----------------------------------------------------------------
def test_lease_is_a_celery_subcommand_with_every_verb(ro):
    result = ro.run("--help")
    assert result.exit_code == 0, result.output
    for verb in VERBS:
        assert f"\n  {verb} " in result.output, verb


def test_migrate_is_idempotent_and_says_so(ro):
    assert f"already at revision {migrations.head()}, nothing to do" in ro.run("migrate").output
    assert ro.json("migrate") == {"store": ro.store.safe_url, "done": [], "revision": migrations.head()}


def test_migrate_sql_prints_the_ddl_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OPS_STORE", f"sqlite:///{tmp_path / 'new.sqlite3'}")
    monkeypatch.setenv("OPS_PREFIX", prefix := unique_prefix())
    monkeypatch.setenv("OPS_BROKER", "memory://")
    result = CliRunner().invoke(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--sql"])
    assert result.exit_code == 0, result.output
    assert f"CREATE TABLE {prefix}jobs" in result.output
    assert f"ALTER TABLE {prefix}workers ADD COLUMN pool" in result.output
    store_file = tmp_path / "new.sqlite3"
    assert not store_file.exists() or b"jobs" not in store_file.read_bytes()


def test_migrate_sql_on_an_existing_store_prints_the_upgrade_from_its_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("OPS_STORE", f"sqlite:///{tmp_path / 'old.sqlite3'}")
    monkeypatch.setenv("OPS_PREFIX", unique_prefix())
    monkeypatch.setenv("OPS_BROKER", "memory://")
    run = CliRunner().invoke
    previous = migrations.revisions()[-2]
    # A new store is created at the older revision: no downgrade, no --yes needed.
    assert run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--to", previous]).exit_code == 0

    upgrade = run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--sql"])
    assert upgrade.exit_code == 0, upgrade.output
    assert f"Running upgrade {previous} -> {migrations.head()}" in upgrade.output
    assert "Running upgrade  -> 0001" not in upgrade.output
    run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate"])
    at_head = run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--sql"])
    assert at_head.exit_code == 0, at_head.output
    assert f"already at revision {migrations.head()}: nothing to run" in at_head.output


def test_a_downgrade_sqlite_cannot_print_as_a_script_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OPS_STORE", f"sqlite:///{tmp_path / 'new.sqlite3'}")
    monkeypatch.setenv("OPS_PREFIX", unique_prefix())
    monkeypatch.setenv("OPS_BROKER", "memory://")
    run = CliRunner().invoke
    assert run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate"]).exit_code == 0
    result = run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--to", "0001", "--sql"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "cannot be printed as a script" in result.output
    assert "lease migrate --to 0001 --yes" in result.output
    assert run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate"]).output.endswith("nothing to do\n")


def test_migrate_to_an_older_revision_rolls_back_and_forward(tmp_path, monkeypatch):
    monkeypatch.setenv("OPS_STORE", f"sqlite:///{tmp_path / 'new.sqlite3'}")
    monkeypatch.setenv("OPS_PREFIX", unique_prefix())
    monkeypatch.setenv("OPS_BROKER", "memory://")
    run = CliRunner().invoke
    assert run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate"]).exit_code == 0
    refused = run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--to", "0001"])
    assert refused.exit_code == 1 and "is a downgrade" in refused.output and "--yes" in refused.output
    at_head = run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--sql"])
    assert f"already at revision {migrations.head()}" in at_head.output  # the refusal changed nothing
    down = run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate", "--to", "0001", "--yes"])
    assert down.exit_code == 0, down.output
    assert f"downgraded revision {migrations.head()} -> 0001" in down.output
    up = run(celery, ["-A", "tests.apps.ops_app", "lease", "migrate"])
    assert f"upgraded revision 0001 -> {migrations.head()}" in up.output, up.output


def test_migrate_creates_the_tables_of_a_new_store(tmp_path, monkeypatch):
    monkeypatch.setenv("OPS_STORE", f"sqlite:///{tmp_path / 'new.sqlite3'}")
    monkeypatch.setenv("OPS_PREFIX", unique_prefix())
    monkeypatch.setenv("OPS_BROKER", "memory://")
    result = CliRunner().invoke(celery, ["-A", "tests.apps.ops_app", "lease", "migrate"])
    assert result.exit_code == 0, result.output
    assert f"created the schema at revision {migrations.head()}" in result.output


# -- status -----------------------------------------------------------------------------
def test_status_table_shows_queues_expired_leases_workers_and_the_last_hour(ro):
    out = ro.run("status").output
    lines = out.splitlines()
    assert any(line.split() == ["celery", "3", "4", "60", "3"] for line in lines), out
    assert any(line.split() == ["reports", "1", "2", "0", "0"] for line in lines), out
    assert "running        6 (4 with an expired lease)" in out
    assert "oldest running abandoned-2 (ops.quick)" in out
    assert "1 alive, 1 stale" in out
    assert "reaped expired lease 2" in out and "duplicate delivery skipped 1" in out
    assert "stale writes rejected 1" in out
    assert "reaper         no run recorded (not scheduled)" in out


def test_status_shows_the_reapers_last_run(rw):
    rw.store.runs.record_reaper_run(0.25, {"reaped": 1}, "reaper@host:7", keep=10)
    report = rw.json("status")["reaper"]
    assert report["last_run"]["worker"] == "reaper@host:7" and 0 <= report["last_run"]["age"] < 30
    assert "on reaper@host:7, took 0.25s (not scheduled)" in rw.run("status").output


def test_status_json_has_every_figure(ro):
    report = ro.json("status")
    assert report["totals"] == {"pending": 4, "running": 6, "completed": 60, "failed": 3}
    assert report["jobs"]["reports"]["running"] == 2
    assert report["running"]["expired"] == 4
    assert report["running"]["oldest"]["id"] == "abandoned-2"
    assert report["running"]["heartbeat_lag_max"] > 100
    assert 0 < report["running"]["heartbeat_lag_p95"] <= report["running"]["heartbeat_lag_max"]
    assert report["workers"] == {"alive": 1, "stale": 1}
    assert report["dead_letters"] == 3
    assert report["last_hour"]["reaped_expired_lease"] == 2
    assert report["last_hour"]["duplicate_delivery_skipped"] == 1
    assert report["last_hour"]["stale_writes_rejected"] == 1


def test_status_counts_every_running_job_not_only_the_rows_it_reads(ro, monkeypatch):
    # The running rows are read up to a bound (10,000); the total is the store's count of them.
    reports = type(ro.store.reports)
    bounded = reports.running_rows
    monkeypatch.setattr(reports, "running_rows",
                        lambda self, limit=10_000, by_start=False: bounded(self, min(limit, 1), by_start))
    report = ro.json("status")
    assert report["running"]["total"] == report["totals"]["running"] == 6
    assert report["running"]["expired"] == 4 and report["running"]["oldest"]["id"] == "abandoned-2"


# -- jobs, inspect, events ----------------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (("--status", "pending"), {"pending-0", "pending-1", "pending-2", "pending-late"}),
    (("--queue", "reports"), {"pending-late", "live-0", "live-1"}),
    (("--task", "ops.fails"), {"failed-0", "failed-1"}),
    (("--status", "running", "--queue", "celery"), {"abandoned-0", "abandoned-1", "abandoned-2",
                                                     "alive-expired"}),
    (("--owner", "dead@ops:2", "--since", "1h"), {"abandoned-0", "abandoned-1", "abandoned-2"}),
])
def test_jobs_filters(ro, args, expected):
    assert {j["id"] for j in ro.json("jobs", *args)} == expected


def test_jobs_expired_lists_oldest_lease_first(ro):
    assert [j["id"] for j in ro.json("jobs", "--expired")] == [
        "abandoned-2", "abandoned-1", "abandoned-0", "alive-expired"]


def test_jobs_limit_caps_the_rows(ro):
    assert len(ro.json("jobs", "--limit", "5")) == 5
    assert len(ro.run("jobs", "--limit", "5").output.strip().splitlines()) == 2 + 5


def test_jobs_table_marks_expired_leases_and_owners(ro):
    out = ro.run("jobs", "--expired").output
    assert out.splitlines()[0].split()[:4] == ["job", "task", "queue", "status"]
    row = next(line for line in out.splitlines() if line.startswith("abandoned-0 "))
    assert "EXPIRED" in row and ops_app.DEAD in row


def test_inspect_shows_the_row_the_message_and_the_history(ro):
    data = ro.json("inspect", "abandoned-0")
    assert data["job"]["id"] == "abandoned-0" and data["job"]["locked_by"] == ops_app.DEAD
    assert data["message"]["task"] == "ops.quick" and data["message"]["args"] == [0]
    assert [(e["event"], e["source"]) for e in data["events"]] == [
        ("published", "event"), ("claimed", "row"), ("reaped_expired_lease", "event")]
    claim = data["events"][1]  # the first claim, as the job's row records it
    assert (claim["worker"], claim["at"]) == (ops_app.DEAD, data["job"]["started_at"])
    out = ro.run("inspect", "abandoned-0").output
    assert "lease_expires_at" in out and "ago)" in out
    assert "reaped_expired_lease" in out and "task: ops.quick" in out


def test_a_job_taken_over_twice_shows_its_three_attempts_in_events_of_the_job(rw):
    attempts = ops_app.taken_over_twice(rw.store, "thrice")

    timeline = rw.json("events", "--job", "thrice")

    assert [(e["event"], e["worker"], e["source"]) for e in timeline] == [
        ("published", None, "event"), ("claimed", "w1", "row"), ("lease_taken_over", "w2", "event"),
        ("lease_taken_over", "w3", "event"), ("completed", "w3", "row")]
    # The first attempt's start and token, as the first takeover read them from the row.
    assert (timeline[1]["at"], timeline[1]["token"]) == (attempts[0][2], attempts[0][1][:8])
    assert [(e["detail"]["previous_owner"], e["detail"]["previous_started_at"]) for e in timeline[2:4]] == [
        ("w1", attempts[0][2]), ("w2", attempts[1][2])]
    job = rw.json("inspect", "thrice")["job"]
    assert (job["attempt_count"], job["locked_by"], job["started_at"]) == (3, "w3", attempts[2][2])
    assert timeline[-1]["at"] == job["completed_at"]
    # Stored events only, without --job: no claim and no completion were written.
    assert [e["event"] for e in rw.json("events", "--limit", "1000") if e["job_id"] == "thrice"] == [
        "published", "lease_taken_over", "lease_taken_over"]


def test_inspect_of_an_unknown_job_says_so_and_what_to_do(ro):
    result = ro.run("inspect", "no-such-job")
    assert result.exit_code == 1
    assert "no job 'no-such-job'" in result.output
    assert "lease jobs`" in result.output  # with the -A value given: tests/unit/test_cli_app.py


def test_events_filter_by_job_name_and_age(ro):
    timeline = ro.json("events", "--job", "failed-0")
    assert [(e["event"], e["source"]) for e in timeline] == [
        ("published", "event"), ("claimed", "row"), ("failed", "event")]
    assert [e["event"] for e in ro.json("events", "--job", "failed-0", "--event", "claimed")] == ["claimed"]
    # Without --job: the stored events only (a first claim wrote none).
    assert "claimed" not in {e["event"] for e in ro.json("events", "--limit", "1000")}
    assert {e["job_id"] for e in ro.json("events", "--event", "reaped_expired_lease")} == {
        "abandoned-0", "abandoned-1"}
    assert len(ro.json("events", "--since", "1h", "--limit", "7")) == 7
    assert ro.json("events", "--since", "1h", "--event", "revoked")[0]["job_id"] == "revoked-0"
    out = ro.run("events", "--job", "failed-0").output
    assert out.splitlines()[0].split() == ["at", "event", "job", "reason", "worker", "token", "source"]
    assert "ValueError: boom" in out


def test_events_of_an_unknown_job_is_a_clear_error_and_of_a_deleted_one_its_history(rw):
    result = rw.run("events", "--job", "nope")
    assert result.exit_code == 1 and "no job 'nope'" in result.output and "lease jobs`" in result.output
    rw.store.event("deleted-7", "dlq_discarded", "discarded by an operator")
    assert [e["event"] for e in rw.json("events", "--job", "deleted-7")] == ["dlq_discarded"]


def test_events_rejects_a_bad_duration(ro):
    result = ro.run("events", "--since", "soon")
    assert result.exit_code == 2 and "not a duration" in result.output


# -- tune -------------------------------------------------------------------------------
def test_tune_measures_runtime_percentiles_per_task(ro):
    ops_app.heartbeat(ro.store, ro.ids["live"])
    by_task = {t["task"]: t for t in ro.json("tune")}
    quick, slow = by_task["ops.quick"], by_task["ops.slow"]
    assert quick["samples"] == 40 and slow["samples"] == 20
    assert quick["runtime_p50"] == pytest.approx(2.05, abs=0.01)
    assert quick["runtime_p99"] == pytest.approx(3.961, abs=0.01)
    assert slow["runtime_p99"] == pytest.approx(28.81, abs=0.01)
    assert quick["current"]["lease_duration"] == 2.0 and slow["current"]["lease_duration"] == 60.0
    assert by_task["ops.fails"]["samples"] == 0


def test_tune_recommends_a_longer_lease_and_warns_where_p99_nears_it(ro):
    ops_app.heartbeat(ro.store, ro.ids["live"])
    quick = ro.json("tune", "--task", "ops.quick")[0]
    rec = quick["recommended"]
    assert rec["lease_duration"] >= 2 * quick["runtime_p99"]
    assert rec["lease_heartbeat_interval"] <= rec["lease_duration"] / 3
    assert any("nears the lease" in w for w in quick["warnings"])
    slow = ro.json("tune", "--task", "ops.slow")[0]
    assert slow["recommended"]["lease_duration"] == 60.0  # 60 s already fits a 28.8 s p99
    assert not any("nears the lease" in w for w in slow["warnings"])
    out = ro.run("tune").output
    assert "ops.quick" in out and "2 -> " in out and "warning: ops.quick:" in out


# -- dead letters -------------------------------------------------------------------------
def test_dlq_list_shows_failed_jobs_oldest_first(ro):
    assert [j["id"] for j in ro.json("dlq", "list")] == ["failed-0", "failed-1", "revoked-0"]
    assert [j["id"] for j in ro.json("dlq", "list", "--task", "ops.fails", "--limit", "1")] == ["failed-0"]
    out = ro.run("dlq", "list").output
    assert "ValueError: boom" in out and "revoked (revoked)" in out


# -- the reaper ---------------------------------------------------------------------------
def test_reap_dry_run_says_what_the_reaper_would_do_and_changes_nothing(ro):
    before = {job_id: ro.store.get(job_id) for job_id in ro.ids["abandoned"] + ro.ids["alive_expired"]}
    plan = ro.json("reap", "--dry-run")
    decisions = {d["job_id"]: d["decision"] for d in plan["planned"]}
    assert decisions == {"abandoned-0": "requeue", "abandoned-1": "requeue", "abandoned-2": "requeue",
                         "alive-expired": "skip_owner_alive"}
    assert plan["dry_run"] is True
    assert {job_id: ro.store.get(job_id) for job_id in before} == before
    out = ro.run("reap", "--dry-run").output
    assert "skip_owner_alive" in out and "dry run:" in out


# -- refusals -----------------------------------------------------------------------------
def test_requeue_refuses_a_live_lease_without_force(ro):
    before = ro.store.get("live-0")
    result = ro.run("requeue", "--job", "live-0")
    assert result.exit_code == 1
    assert "live-0 holds a live lease" in result.output and "--force" in result.output
    assert ro.store.get("live-0") == before


def test_requeue_refuses_an_expired_lease_whose_owner_is_alive(ro):
    result = ro.run("requeue", "--job", "alive-expired")
    assert result.exit_code == 1 and "holds a live lease" in result.output
    assert ro.store.get("alive-expired").status == "running"


@pytest.mark.parametrize(("args", "message"), [
    (("requeue", "--job", "no-such-job"), "no job 'no-such-job'"),
    (("requeue", "--job", "done-ops.quick-0"), "is completed; there is nothing to requeue"),
    (("requeue", "--job", "failed-0"), "dlq redrive --job failed-0"),
    (("requeue", "--job", "pending-0"), "Use --force to re-publish"),
    (("dlq", "redrive", "--job", "live-0"), "not a dead letter"),
    (("dlq", "redrive", "--job", "no-such-job"), "no job 'no-such-job'"),
    (("requeue",), "--job ID or take expired leases with --expired"),
])
def test_recovery_refusals_name_the_job_and_what_to_do(ro, args, message):
    result = ro.run(*args)
    assert result.exit_code == 1, result.output
    assert message in result.output


def test_store_unreachable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OPS_STORE", "postgresql+psycopg://postgres@127.0.0.1:1/none")
    monkeypatch.setenv("OPS_PREFIX", unique_prefix())
    monkeypatch.setenv("OPS_BROKER", "memory://")
    result = CliRunner().invoke(celery, ["-A", "tests.apps.ops_app", "lease", "status"])
    assert result.exit_code == 69
    assert "unreachable" in result.output and "lease_store_url" in result.output


# -- manual recovery ----------------------------------------------------------------------
def test_requeue_expired_takes_only_abandoned_leases_a_batch_at_a_time(rw, broker):
    first = rw.json("requeue", "--yes", "--expired", "--batch", "2")
    assert [o["job_id"] for o in first["outcomes"]] == ["abandoned-2", "abandoned-1"]
    assert first["requeued"] == 2 and first["batch"] == 2
    out = rw.run("requeue", "--yes", "--expired").output
    assert "abandoned-0" in out and "requeued 1," in out
    assert "nothing to do" in rw.run("requeue", "--yes", "--expired").output
    for job_id in rw.ids["abandoned"]:
        job = rw.store.get(job_id)
        assert (job.status, job.lock_token, job.locked_by, job.expired_count) == ("pending", None, None, 1)
        event = rw.store.reports.list_events(job_id=job_id, event="manual_requeue")
        assert len(event) == 1 and event[0]["worker"].startswith("cli:")
    assert sorted(queued_ids(broker, "celery")) == sorted(rw.ids["abandoned"])
    for job_id in rw.ids["live"] + rw.ids["alive_expired"]:
        assert rw.store.get(job_id).status == "running"


def test_requeue_refuses_an_abandoned_lease_while_the_reapers_hold_covers_its_owner(rw, broker):
    # The store was away or its clock stepped: every lease looks expired, every owner gone; the reaper
    # waits a lease and a heartbeat, and so does requeue without --force.
    now = rw.store.now()
    rw.store.reaping.record_reaper_clock({"at": now, "calm_since": now}, held_back="the clock stepped")
    result = rw.run("requeue", "--yes", "--job", "abandoned-0")
    assert result.exit_code == 1 and "the store was away or its clock stepped" in result.output
    assert "nothing to do" in rw.run("requeue", "--yes", "--expired").output
    assert {rw.store.get(job_id).status for job_id in rw.ids["abandoned"]} == {"running"}
    assert rw.run("requeue", "--yes", "--force", "--job", "abandoned-0").exit_code == 0
    assert rw.store.get("abandoned-0").status == "pending"


def test_requeue_force_takes_a_live_lease_and_fences_its_old_owner(rw, broker):
    old = rw.store.get("live-0")
    result = rw.run("requeue", "--yes", "--job", "live-0", "--force")
    assert result.exit_code == 0, result.output
    job = rw.store.get("live-0")
    assert job.status == "pending" and job.lock_token is None
    assert rw.store.reports.list_events(job_id="live-0", event="manual_requeue")[0]["detail"]
    assert queued_ids(broker, "reports") == ["live-0"]
    assert rw.store.jobs.complete("live-0", old.lock_token, old.locked_by) is False


def test_requeue_force_re_publishes_a_pending_job(rw, broker):
    assert rw.json("requeue", "--yes", "--job", "pending-late", "--force")["requeued"] == 1
    assert queued_ids(broker, "reports") == ["pending-late"]
    assert rw.store.get("pending-late").dispatch_count == 1


def test_requeue_shows_a_progress_bar_on_a_terminal_only(rw, broker, monkeypatch):
    assert "requeueing" not in rw.run("requeue", "--yes", "--expired", "--batch", "1").stderr
    monkeypatch.setattr("celery_lease.cli.manual.is_tty", lambda: True)
    assert "requeueing" in rw.run("requeue", "--yes", "--expired", "--batch", "1").stderr
    assert "requeueing" not in rw.run("requeue", "--yes", "--expired", "--batch", "1", "--json").stderr


def test_requeue_reports_a_publish_failure_and_exits_non_zero(rw, monkeypatch):
    monkeypatch.setenv("OPS_BROKER", "redis://127.0.0.1:1/0")
    monkeypatch.setattr(ops_app, "_apps", {})
    app = ops_app.app
    app.conf.task_publish_retry = False
    app.conf.broker_transport_options = {"max_retries": 0}  # kombu retries a refused connection for 6 s
    app_state(app).store = rw.store
    result = rw.run("requeue", "--yes", "--job", "abandoned-0", "--json")
    assert result.exit_code == 1
    outcome = json.loads(result.stdout)["outcomes"][0]
    assert outcome["action"] == "publish_failed" and "lease_dispatch_timeout" in outcome["reason"]
    assert rw.store.get("abandoned-0").status == "pending"


def test_dlq_redrive_sends_dead_letters_back_with_fresh_attempts(rw, broker):
    first = rw.json("dlq", "redrive", "--yes", "--batch", "1")
    assert [o["job_id"] for o in first["outcomes"]] == ["failed-0"] and first["redriven"] == 1
    job = rw.store.get("failed-0")
    assert (job.status, job.attempt_count, job.failed_at) == ("pending", 0, None)
    assert job.idempotency_key == "fails-0"
    assert rw.store.reports.list_events(job_id="failed-0",
                                        event="dlq_redriven")[0]["reason"] == "ValueError: boom"
    out = rw.run("dlq", "redrive", "--yes").output  # the revoked job stays out of a batch
    assert "failed-1" in out and "revoked-0" not in out and "redriven 1," in out
    assert rw.json("dlq", "redrive", "--yes", "--job", "revoked-0")["redriven"] == 1
    assert sorted(queued_ids(broker, "celery")) == ["failed-0", "failed-1", "revoked-0"]
    assert rw.store.publishes.record("again", "ops.fails", "celery", None, 3, idempotency_key="fails-0") == (
        False, "failed-0")


# -- check --------------------------------------------------------------------------------
def test_check_prints_each_finding_and_fails_on_an_error(ro):
    result = ro.run("check")
    assert result.exit_code == 1
    assert "ERROR   reaper_scheduled" in result.output and "fix:      add {'lease-reaper'" in result.output
    assert "1 check(s) failed" in result.output
    findings = json.loads(ro.run("check", "--json").stdout)
    assert {"level": "error", "code": "reaper_scheduled"}.items() <= next(
        f for f in findings if f["code"] == "reaper_scheduled").items()


def test_check_passes_with_warnings_only(ro, monkeypatch):
    monkeypatch.setitem(ro.app.conf, "beat_schedule",
                        {"lease-reaper": {"task": "celery_lease.reap", "schedule": 15.0}})
    result = ro.run("check")
    assert result.exit_code == 0, result.output
    assert "0 error(s)" in result.output and "WARNING" in result.output


def test_reap_runs_one_reaper_cycle_now(rw, broker):
    result = rw.json("reap")
    assert result["reaped"] == 3 and result["skipped_owner_alive"] == 1 and result["dry_run"] is False
    assert {rw.store.get(job_id).status for job_id in rw.ids["abandoned"]} == {"pending"}
    assert rw.store.get("alive-expired").status == "running"
    assert sorted(queued_ids(broker, "celery")) == sorted(rw.ids["abandoned"])
    assert rw.run("reap").output.startswith("reaped: seen=")
