"""``lease check``: every rule, table-driven: the bad config, the exact finding, the fix.

A clean baseline app answers every question with ``ok``; each case changes one thing
and must produce exactly the finding in the table, and no other problem.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.config import app_config
from celery_lease.ops.check_context import Context, Finding
from celery_lease.ops.checks import run_checks
from celery_lease.ops.tuning import tune
from celery_lease.store import ClaimTerms, Store
from celery_lease.vocabulary import OnLost, Severity
from tests.conftest import unique_prefix

REDIS = "redis://127.0.0.1:6379/9"  # never connected to: the checks read the URL and options
AMQP = "amqp://guest:guest@127.0.0.1:5672//"
REAPER = {"lease-reaper": {"task": "celery_lease.reap", "schedule": 15.0,
                           "options": {"queue": "lease-maintenance", "expires": 10.0}}}
VT = "broker_transport_options['visibility_timeout']"
BASE_CONF = dict(task_acks_late=True, worker_prefetch_multiplier=1, beat_schedule=REAPER)


def locked_body(self):
    with self.lease.lock("account:1"):
        return 1


def plain_body(*args):
    return 1


def make_app(broker: str = REDIS, tasks: dict[str, dict[str, Any]] | None = None, plain: bool = False,
             locks: bool = True, **conf: Any) -> Celery:
    app = Celery(f"checks_{unique_prefix()}", broker=broker, set_as_current=False)
    app.conf.update({**BASE_CONF, "lease_store_url": "sqlite://", **conf})
    for name, options in (tasks if tasks is not None else {"c.work": {"time_limit": 30}}).items():
        app.task(base=LeaseTask, bind=True, shared=False, name=name, **options)(
            locked_body if locks else plain_body)
    if plain:
        app.task(shared=False, name="c.plain")(plain_body)
    return app


def run_job(store: Store, name: str = "c.work", seconds: float = 1.0, key: str | None = "k",
            status: str = "completed", delay: float = 0.0) -> str:
    """A job of ``name`` in the store: finished after ``seconds``, or pending ``delay`` ahead."""
    job_id = unique_prefix()
    store.publishes.record(job_id, name, "celery", None, 5, f"{key}-{job_id}" if key else None, delay)
    if status == "pending":
        return job_id
    claim = store.jobs.claim(job_id, "w1@host:1", f"tok{job_id}",
                             ClaimTerms(duration=30.0, grace=10.0,
                                        max_attempts=5, max_expirations=3, takeover=False),
                             task_name=name, queue="celery", payload=lambda: None)
    assert claim.claimed
    if status == "completed":
        assert store.jobs.complete(job_id, f"tok{job_id}")
    else:
        assert store.jobs.fail(job_id, f"tok{job_id}", "boom")
    j = store.t.jobs
    finished = j.c.completed_at if status == "completed" else j.c.failed_at
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(started_at=finished - seconds))
    return job_id


@pytest.fixture
def sqlite_store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'lease.sqlite3'}", unique_prefix())
    store.migrate()
    yield store
    store.engine.dispose()


def baseline_store(store: Store) -> Store:
    """Measured runs with idempotency keys, one recovery seen, a reaper run and a scrape recorded."""
    run_job(store)
    store.event(None, "lease_taken_over", "test")
    store.workers.touch_worker("w1@host:1", "w1@host", 1)
    store.runs.record_reaper_run(0.1, {"reaped": 0}, "reaper@host:1", keep=10)
    store.runs.set_meta("exporter_last_scrape", "host:1")
    return store


def problems(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level != "ok"]


def test_the_clean_baseline_answers_every_question_ok(sqlite_store):
    findings = run_checks(make_app(), baseline_store(sqlite_store))
    assert problems(findings) == []
    assert {f.code for f in findings} >= {
        "heartbeat_vs_lease", "grace_vs_heartbeat", "time_limit_vs_lease", "prefetch_long_tasks", "acks_late",
        "reaper_scheduled", "store_reachable", "sqlite_multi_host", "visibility_vs_runtime",
        "visibility_vs_eta", "visibility_vs_lease", "durations_measured", "timeout_vs_p99",
        "heartbeat_for_long_jobs", "idempotency",
        "locks", "backoff", "dead_letter", "dashboards", "crash_tested"}
    json.dumps([f.as_dict() for f in findings])  # --json can print every finding


# (id, app keywords, store setup, level, code, settings, values, fix)
CASES = [
    ("config_invalid", dict(lease_duration=-1), None,
     "error", "config_invalid", ("lease_duration",), {"lease_duration": -1},
     "set lease_duration to a number of seconds > 0"),
    ("heartbeat_vs_lease_app", dict(lease_duration=30.0, lease_heartbeat_interval=20.0), None,
     "error", "heartbeat_vs_lease", ("lease_heartbeat_interval",), {"lease_heartbeat_interval": 20.0},
     "lower lease_heartbeat_interval to at most a third of lease_duration, or lengthen the lease"),
    ("heartbeat_vs_lease_task",
     dict(tasks={"c.work": {"time_limit": 30, "lease_duration": 6.0, "lease_heartbeat_interval": 5.0}}), None,
     "error", "heartbeat_vs_lease", ("lease_heartbeat_interval",),
     {"task": "c.work", "lease_heartbeat_interval": 5.0},
     "lower lease_heartbeat_interval to at most a third of lease_duration, or lengthen the lease"),
    ("grace_vs_heartbeat", dict(lease_grace_period=0.5), None,
     "warning", "grace_vs_heartbeat", ("lease_grace_period", "lease_heartbeat_interval"),
     {"task": "c.work", "lease_grace_period": 0.5, "lease_heartbeat_interval": 10.0},
     "set lease_grace_period >= lease_heartbeat_interval (10s) for c.work"),
    ("max_runtime_vs_time_limit", dict(tasks={"c.work": {"time_limit": 30, "lease_max_runtime": 20.0}}), None,
     "warning", "max_runtime_vs_time_limit", ("lease_max_runtime", "task_time_limit"),
     {"task": "c.work", "lease_max_runtime": 20.0, "time_limit": 30.0},
     "set lease_max_runtime >= time_limit (30s) for c.work, or lower its time_limit"),
    ("blocking_heartbeat_gevent", dict(worker_pool="gevent", tasks={"c.work": {"time_limit": 60}}), None,
     "warning", "blocking_heartbeat", ("worker_pool", "task_time_limit", "lease_duration"),
     {"task": "c.work", "worker_pool": "gevent", "time_limit": 60.0, "lease_duration": 30.0,
      "lease_grace_period": 10.0},
     "run it in the prefork or threads pool, or keep every blocking call shorter than lease_duration "
     "(lease.extend(seconds) before a long one), or set time_limit <= 40s"),
    ("blocking_heartbeat_solo", dict(worker_pool="solo", tasks={"c.work": {}}), None,
     "warning", "blocking_heartbeat", ("worker_pool", "task_time_limit", "lease_duration"),
     {"task": "c.work", "worker_pool": "solo", "time_limit": None, "lease_duration": 30.0,
      "lease_grace_period": 10.0},
     "run it in the prefork or threads pool, or keep every blocking call shorter than lease_duration "
     "(lease.extend(seconds) before a long one)"),
    ("runtime_limit_unenforced", dict(worker_pool="threads", tasks={"c.work": {"time_limit": 60}}), None,
     "warning", "runtime_limit_unenforced", ("lease_max_runtime", "task_time_limit", "worker_pool"),
     {"task": "c.work", "worker_pool": "threads", "time_limit": 60.0, "lease_max_runtime": None},
     "set lease_max_runtime for c.work (past it the lease is lost and the body gets LeaseLost), "
     "or run it in the prefork or gevent pool"),
    ("prefetch_long_tasks", dict(worker_prefetch_multiplier=4, tasks={"c.work": {"time_limit": 600}}), None,
     "warning", "prefetch_long_tasks", ("worker_prefetch_multiplier",),
     {"worker_prefetch_multiplier": 4, "long_tasks": {"c.work": 600.0}},
     "set worker_prefetch_multiplier = 1 (and start workers with -O fair)"),
    ("acks_late", dict(task_acks_late=False), None,
     "warning", "acks_late", ("task_acks_late", "task_reject_on_worker_lost"),
     {"task_acks_late": False, "task_reject_on_worker_lost": None, "tasks": ["c.work"]},
     "set task_acks_late = True (celery_lease skips the duplicates it lets through)"),
    ("reject_on_worker_lost", dict(task_reject_on_worker_lost=True), None,
     "warning", "reject_on_worker_lost", ("task_acks_late", "task_reject_on_worker_lost"),
     {"task_acks_late": True, "task_reject_on_worker_lost": True, "tasks": ["c.work"]},
     "leave task_reject_on_worker_lost off: celery_lease requeues the job itself, counting attempts"),
    ("reject_without_acks_late", dict(task_acks_late=False, task_reject_on_worker_lost=True), None,
     "warning", "reject_on_worker_lost", ("task_acks_late", "task_reject_on_worker_lost"),
     {"task_acks_late": False, "task_reject_on_worker_lost": True, "tasks": ["c.work"]},
     "remove task_reject_on_worker_lost, or set task_acks_late = True"),
    ("reaper_scheduled", dict(beat_schedule={"other": {"task": "x.y", "schedule": 5}}), None,
     "error", "reaper_scheduled", ("beat_schedule",), {"beat_schedule": ["other"]},
     "add {'lease-reaper': {'task': 'celery_lease.reap', 'schedule': 15.0}} to beat_schedule and run "
     "celery beat"),
    ("sqlite_multi_host", {}, lambda s: s.workers.touch_worker("w2@other-host:9", "w2@other-host", 9),
     "error", "sqlite_multi_host", ("lease_store_url",), {"worker_hosts": ["host", "other-host"]},
     "use PostgreSQL or MySQL/MariaDB for lease_store_url"),
    ("visibility_vs_runtime",
     dict(lease_extend_visibility=False, tasks={"c.work": {"time_limit": 30}},
          broker_transport_options={"visibility_timeout": 20}), None,
     "error", "visibility_vs_runtime", (VT, "lease_extend_visibility"),
     {"visibility_timeout": 20.0, "lease_extend_visibility": False, "task": "c.work", "time_limit": 30.0,
      "lease_max_runtime": 30.0, "p99": 1.0},
     "set lease_extend_visibility = True, or raise visibility_timeout above the longest run"),
    ("visibility_vs_eta", dict(lease_extend_visibility=False),
     lambda s: run_job(s, status="pending", delay=7200),
     "error", "visibility_vs_eta", (VT, "lease_extend_visibility"),
     {"visibility_timeout": 3600.0, "lease_extend_visibility": False, "task": "c.work",
      "longest_delay": 7200.0},
     "set lease_extend_visibility = True, or raise visibility_timeout above the longest countdown"),
    ("visibility_vs_lease", dict(broker_transport_options={"visibility_timeout": 20}), None,
     "warning", "visibility_vs_lease",
     (VT, "lease_duration", "lease_grace_period", "lease_worker_stale_after"),
     {"visibility_timeout": 20.0, "lease_extend_visibility": True, "takeover_after": 40.0},
     "raise visibility_timeout to at least 40s, or shorten lease_worker_stale_after"),
    ("consumer_timeout_default", dict(broker=AMQP, tasks={"c.work": {"time_limit": 3600}}), None,
     "error", "consumer_timeout",
     ("consumer_timeout", "lease_rabbitmq_consumer_timeout", "task_time_limit", "lease_max_runtime"),
     {"task": "c.work", "queue": "celery", "consumer_timeout": 1800.0, "source": "RabbitMQ default",
      "time_limit": 3600.0, "lease_max_runtime": 3600.0, "p99": 1.0},
     "raise consumer_timeout (rabbitmq.conf, in ms) above 3600s or per queue with the x-consumer-timeout "
     "argument; or lower the task's time_limit / lease_max_runtime below it"),
    ("consumer_timeout_setting", dict(broker=AMQP, lease_rabbitmq_consumer_timeout=20.0), None,
     "error", "consumer_timeout",
     ("consumer_timeout", "lease_rabbitmq_consumer_timeout", "task_time_limit", "lease_max_runtime"),
     {"task": "c.work", "queue": "celery", "consumer_timeout": 20.0,
      "source": "lease_rabbitmq_consumer_timeout", "time_limit": 30.0, "lease_max_runtime": 30.0, "p99": 1.0},
     "raise consumer_timeout (rabbitmq.conf, in ms) above 30s or per queue with the x-consumer-timeout "
     "argument; or lower the task's time_limit / lease_max_runtime below it"),
    ("consumer_timeout_unbounded", dict(broker=AMQP, tasks={"c.new": {}}), None,
     "warning", "consumer_timeout",
     ("consumer_timeout", "lease_rabbitmq_consumer_timeout", "task_time_limit", "lease_max_runtime"),
     {"tasks": ["c.new"], "consumer_timeouts": {"celery": (1800.0, "RabbitMQ default")}},
     "set time_limit (or lease_max_runtime) below consumer_timeout"),
    ("consumer_timeout_eta", dict(broker=AMQP, lease_rabbitmq_consumer_timeout=1800.0),
     lambda s: run_job(s, status="pending", delay=7200),
     "error", "consumer_timeout_eta", ("consumer_timeout", "lease_rabbitmq_consumer_timeout"),
     {"task": "c.work", "queue": "celery", "consumer_timeout": 1800.0,
      "source": "lease_rabbitmq_consumer_timeout", "longest_delay": 7200.0},
     "raise consumer_timeout (rabbitmq.conf, in ms) above 7200s or per queue with the x-consumer-timeout "
     "argument; or keep c.work's countdowns/ETAs below 1800s"),
    ("broker_visibility_unknown", dict(broker="zookeeper://127.0.0.1:2181/"), None,
     "warning", "broker_visibility", ("broker_url",), {"transport": "zookeeper"},
     "make the transport's redelivery timeout longer than the longest task"),
    ("durations_measured", dict(tasks={"c.work": {"time_limit": 30}, "c.new": {"time_limit": 30}}), None,
     "warning", "durations_measured", (),
     {"unmeasured": ["c.new"], "measured": {"c.work": {"runs": 1, "p50": 1.0, "p95": 1.0, "p99": 1.0}}},
     "let them run (staging or production), then run `celery lease check` and `celery lease tune`"),
    ("timeout_vs_p99", {}, lambda s: [run_job(s, seconds=45.0) for _ in range(3)],
     "error", "timeout_vs_p99", ("time_limit",), {"task": "c.work", "time_limit": 30.0, "p99": 45.0},
     "raise time_limit above the p99 (45s) with room for the tail, or split the task"),
    ("heartbeat_for_long_jobs", dict(plain=True), None,
     "warning", "heartbeat_for_long_jobs", ("task_cls",), {"plain_tasks": ["c.plain"]},
     "declare long or important tasks with base=LeaseTask (or set the app's task_cls)"),
    ("idempotency", dict(tasks={"c.work": {"time_limit": 30}, "c.bare": {"time_limit": 30}}),
     lambda s: run_job(s, name="c.bare", key=None),
     "warning", "idempotency", (), {"tasks": ["c.bare"]},
     "for each side effect, `with self.lease.effect(key) as first:` (or publish with "
     "apply_async(idempotency_key=...)); ignore this for tasks without side effects"),
    ("locks", dict(locks=False), None,
     "warning", "locks", ("lease_lock_ttl",), {"tasks_using_locks": []},
     "wrap critical sections in `with self.lease.lock(f'account:{id}'):`; ignore this if no resource is "
     "shared"),
    ("backoff_lease", dict(lease_backoff_base=0.0), None,
     "warning", "backoff", ("lease_backoff_base", "lease_backoff_max"),
     {"task": "c.work", "lease_backoff_base": 0.0, "lease_backoff_max": 300.0},
     "set lease_backoff_base > 0 (e.g. 1.0) and lease_backoff_max > it"),
    ("backoff_autoretry",
     dict(tasks={"c.work": {"time_limit": 30, "autoretry_for": (KeyError,), "default_retry_delay": 0}}), None,
     "warning", "backoff", ("retry_backoff", "default_retry_delay"),
     {"task": "c.work", "retry_backoff": False, "default_retry_delay": 0},
     "set retry_backoff=True (and retry_jitter) on the task, or a default_retry_delay of seconds"),
    ("dead_letter_consumed", dict(lease_dead_letter_queue="celery"), None,
     "warning", "dead_letter", ("lease_dead_letter_queue",),
     {"task": "c.work", "lease_dead_letter_queue": "celery"},
     "use a queue no worker consumes, e.g. 'dead_letter', and inspect it with `celery lease dlq list`"),
    ("dead_letter_waiting", {}, lambda s: run_job(s, status="failed"),
     "warning", "dead_letter", ("lease_dead_letter_queue",), {"failed_jobs": {"c.work": 1}},
     "inspect them with `celery lease dlq list`, fix the cause, then `celery lease dlq redrive`"),
]


# A task that never ran is also unmeasured: that finding comes with it.
# Without acks_late, the acks_late finding comes with the reject one.
ALSO = {"consumer_timeout": {"durations_measured"}, "reject_on_worker_lost": {"acks_late"},
        "blocking_heartbeat": {"runtime_limit_unenforced"}}


@pytest.mark.parametrize(("app_kw", "prepare", "level", "code", "settings", "values", "fix"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_rule_reports_its_bad_config_with_the_fix(sqlite_store, app_kw, prepare, level, code, settings,
                                                         values, fix):
    store = baseline_store(sqlite_store)
    if prepare:
        prepare(store)
    findings = run_checks(make_app(**app_kw), store)
    found = [f for f in problems(findings) if f.code not in ALSO.get(code, ())]
    assert [(f.level, f.code) for f in found] == [(level, code)], [f.as_dict() for f in found]
    finding = found[0]
    assert finding.settings == settings
    assert {k: v for k, v in finding.values.items() if k != "lease_store_url"} == values
    assert finding.fix == fix
    assert finding.why  # every finding says why it matters


def test_lease_check_reports_every_config_problem_with_a_fix_naming_it_as_written(sqlite_store):
    findings = run_checks(make_app(lease_duraton=60, lease_heartbeat_intervl=5), baseline_store(sqlite_store))
    assert [(f.code, f.settings, f.fix) for f in problems(findings)] == [
        ("config_invalid", ("lease_duraton",), "rename lease_duraton to lease_duration"),
        ("config_invalid", ("lease_heartbeat_intervl",),
         "rename lease_heartbeat_intervl to lease_heartbeat_interval"),
    ]
    assert "Did you mean lease_duration?" in problems(findings)[0].why


def test_an_unreachable_store_is_an_error_and_store_questions_are_not_guessed():
    store = Store("postgresql+psycopg://postgres@127.0.0.1:1/nowhere", unique_prefix())
    findings = run_checks(make_app(), store)
    (error,) = [f for f in findings if f.level == "error"]
    assert (error.code, error.settings) == ("store_reachable", ("lease_store_url",))
    assert error.fix == ("check lease_store_url and that the database is running and reachable from every "
                         "worker")
    assert [f.code for f in problems(findings)] == ["store_reachable", "durations_measured"]


def test_an_unreachable_store_leaves_no_store_question_answered_ok():
    store = Store("postgresql+psycopg://postgres@127.0.0.1:1/nowhere", unique_prefix())
    answered = {f.code for f in run_checks(make_app(), store) if f.level == "ok"}
    assert not answered & {"dead_letter", "idempotency", "timeout_vs_p99"}, answered


def test_dead_letters_of_a_task_the_app_no_longer_has_are_reported_waiting(sqlite_store):
    run_job(baseline_store(sqlite_store), name="c.removed", status="failed")
    (finding,) = [f for f in run_checks(make_app(), sqlite_store) if f.code == "dead_letter"]
    assert finding.level == "warning" and finding.values == {"failed_jobs": {"c.removed": 1}}


def test_a_store_without_tables_is_reported_unmigrated(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'empty.sqlite3'}", "empty_")
    (error,) = [f for f in run_checks(make_app(), store) if f.level == "error"]
    assert error.code == "store_migrated" and error.fix.startswith("run `celery -A proj lease migrate`")
    assert "no celery_lease tables" in error.why and error.values["revision"] is None


def test_a_store_at_an_old_revision_is_reported_with_both_revisions(tmp_path):
    from celery_lease.store import migrations

    store = Store(f"sqlite:///{tmp_path / 'old.sqlite3'}", "old_")
    store.migrate(to="0001")
    (error,) = [f for f in run_checks(make_app(), store) if f.level == "error"]
    oldest, newest = migrations.supported()
    assert error.code == "store_migrated" and error.values["revision"] == "0001"
    assert error.values["supported"] == f"{oldest}..{newest}"
    assert "runs against revisions" in error.why


def test_a_migrated_store_reports_its_revision(sqlite_store):
    from celery_lease.store import migrations

    (ok,) = [f for f in run_checks(make_app(), sqlite_store) if f.code == "store_reachable"]
    assert ok.values["revision"] == migrations.head()
    assert f"revision {migrations.head()}" in ok.why


def test_dashboards_warn_until_an_exporter_scrape_is_recorded(sqlite_store):
    run_job(sqlite_store)
    sqlite_store.event(None, "lease_taken_over", "test")
    sqlite_store.runs.record_reaper_run(0.1, {}, "reaper@host:1", keep=10)
    (finding,) = problems(run_checks(make_app(), sqlite_store))
    assert (finding.level, finding.code) == ("warning", "dashboards")
    assert finding.values == {"last_scrape_age": None, "exporter": None}
    assert finding.fix.startswith("pip install celery-lease[metrics]")


def test_dashboards_warn_when_the_last_scrape_is_old(sqlite_store):
    store = baseline_store(sqlite_store)
    m = store.t.meta
    with store.begin() as c:
        c.execute(sa.update(m).values(updated_at=m.c.updated_at - 3600))
    (finding,) = problems(run_checks(make_app(), store))
    assert (finding.level, finding.code) == ("warning", "dashboards")
    assert finding.values["last_scrape_age"] >= 3600


def test_a_scheduled_reaper_never_seen_running_says_so(sqlite_store):
    run_job(sqlite_store)
    sqlite_store.event(None, "lease_taken_over", "test")
    sqlite_store.runs.set_meta("exporter_last_scrape", "host:1")
    (finding,) = problems(run_checks(make_app(), sqlite_store))
    assert (finding.level, finding.code) == ("warning", "reaper_running")
    assert finding.values == {"last_run": None, "interval": 15.0}


def test_a_reaper_that_missed_three_intervals_is_an_error(sqlite_store):
    store = baseline_store(sqlite_store)
    r = store.t.reaper_runs
    with store.begin() as c:
        c.execute(sa.update(r).values(finished_at=r.c.finished_at - 50))
    (finding,) = problems(run_checks(make_app(), store))
    assert (finding.level, finding.code) == ("error", "reaper_running")
    assert finding.values["last_run_age"] >= 50 and finding.values["interval"] == 15.0
    assert finding.values["worker"] == "reaper@host:1"


def test_a_recent_reaper_run_is_ok(sqlite_store):
    findings = run_checks(make_app(), baseline_store(sqlite_store))
    (finding,) = [f for f in findings if f.code == "reaper_running"]
    assert finding.level == "ok" and finding.values["last_run_age"] < 30


@pytest.mark.parametrize("options", [{}, {"queue": "celery", "expires": 10.0}, {"queue": "lease-maintenance"},
                                     {"queue": "lease-maintenance", "expires": 20.0}],
                         ids=["no-options", "work-queue", "no-expires", "expires-after-interval"])
def test_a_reaper_on_a_work_queue_or_without_expires_is_flagged(sqlite_store, options):
    beat = {"lease-reaper": {"task": "celery_lease.reap", "schedule": 15.0, "options": options}}
    (finding,) = problems(run_checks(make_app(beat_schedule=beat), baseline_store(sqlite_store)))
    assert (finding.level, finding.code) == ("warning", "reaper_routing")
    assert "lease-maintenance" in finding.fix and "expires" in finding.fix


@pytest.mark.parametrize(("schedule", "level"), [(15.0, "ok"), (90.0, "warning")])
def test_a_reaper_running_further_apart_than_the_registry_silence_is_flagged(sqlite_store, schedule, level):
    beat = {"lease-reaper": {"task": "celery_lease.reap", "schedule": schedule,
                             "options": {"queue": "lease-maintenance", "expires": 10.0}}}
    findings = run_checks(make_app(beat_schedule=beat), baseline_store(sqlite_store))
    (finding,) = [f for f in findings if f.code == "reaper_interval"]
    assert finding.level == level and finding.values["interval"] == schedule
    if level == "warning":
        assert finding.values["lease_worker_stale_after"] < schedule
        assert "lease_worker_stale_after" in finding.fix


def test_crash_tests_warn_until_a_recovery_is_recorded(sqlite_store):
    run_job(sqlite_store)
    sqlite_store.runs.record_reaper_run(0.1, {}, "reaper@host:1", keep=10)
    sqlite_store.runs.set_meta("exporter_last_scrape", "host:1")
    (finding,) = problems(run_checks(make_app(), sqlite_store))
    assert (finding.level, finding.code) == ("warning", "crash_tested")
    assert finding.values == {"recoveries": dict.fromkeys(
        ("lease_taken_over", "reaped_expired_lease", "redispatched"), 0)}
    sqlite_store.event(None, "reaped_expired_lease", "test")
    assert problems(run_checks(make_app(), sqlite_store)) == []


def test_sqs_warns_when_long_jobs_outlive_its_visibility_and_the_extension_is_off(sqlite_store):
    for extend, expected in ((False, "warning"), (True, "ok")):
        # Nothing listens on port 9: the queue's own attributes cannot be read.
        app = make_app("sqs://AKID:secret@127.0.0.1:9", lease_extend_visibility=extend,
                       broker_transport_options={"visibility_timeout": 10, "is_secure": False})
        ctx = Context(app, app_config(app), baseline_store(sqlite_store))
        assert ctx.transport == "sqs"
        visibility, queue = sqs_finding(ctx, "sqs_visibility"), sqs_finding(ctx, "sqs_queue")
        assert (visibility.level, queue.level) == (expected, "warning")
    assert visibility.why == "held messages get ChangeMessageVisibility while leased"
    assert queue.why.startswith("queue celery: its attributes could not be read")


def sqs_finding(ctx: Context, code: str | None = None, level: str | None = None) -> Finding:
    """The one SQS finding of ``code`` (or of ``level``) that the broker rules give."""
    from celery_lease.ops.broker_checks import broker_rules

    found = [f for f in broker_rules(ctx) if code in (None, f.code) and level in (None, f.level)]
    assert len(found) == 1, f"expected one {code or level} finding, got {found}"
    return found[0]


def sqs_queue(sqs_url: str, name: str, visibility: int, max_receives: int | None) -> None:
    """Create ``name`` on moto's SQS server with its visibility timeout and redrive policy."""
    import boto3

    client = boto3.client("sqs", endpoint_url=f"http://127.0.0.1:{sqs_url.rsplit(':', 1)[1]}",
                          region_name="us-east-1")
    attributes = {"VisibilityTimeout": str(visibility)}
    if max_receives is not None:
        dlq = client.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        arn = client.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        attributes["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": arn,
                                                  "maxReceiveCount": max_receives})
    client.create_queue(QueueName=name, Attributes=attributes)


@pytest.mark.parametrize(("queue_vt", "max_receives", "extend", "level", "first"), [
    (60, 3, True, "warning", "SQS ends the job first"),  # 3 receives <= 5 attempts
    (60, 5, True, "warning", "SQS ends the job first"),  # as many receives as attempts: the skips count
    (60, 6, True, "ok", "the lease ends the job first"),
    (60, None, True, "ok", "no redrive policy"),
    (10, 2, False, "error", "SQS ends the job first: without the extension one run of 30s is received 3"),
    (10, 6, False, "ok", "the lease ends the job first"),  # 3 receives a run, 6 allowed
], ids=["receives-below-attempts", "receives-equal-attempts", "receives-above-attempts", "no-redrive",
        "no-extension-redrive-mid-run", "no-extension-receives-to-spare"])
def test_sqs_check_says_whether_the_redrive_or_the_lease_ends_a_job_first(
        sqs_url, sqlite_store, queue_vt, max_receives, extend, level, first):

    prefix = unique_prefix().replace("_", "-")
    sqs_queue(sqs_url, f"{prefix}celery", queue_vt, max_receives)
    app = make_app(sqs_url, lease_extend_visibility=extend, lease_max_attempts=5,
                   broker_transport_options={"region": "us-east-1", "is_secure": False,
                                             "queue_name_prefix": prefix, "visibility_timeout": queue_vt})
    ctx = Context(app, app_config(app), baseline_store(sqlite_store))
    finding = sqs_finding(ctx, "sqs_queue")
    assert (finding.level, finding.settings) == (level, ("VisibilityTimeout", "maxReceiveCount",
                                                         "lease_max_attempts"))
    assert first in finding.why and "c.work" in finding.why
    assert finding.values["queue_visibility_timeout"] == queue_vt
    assert finding.values["max_receive_count"] == max_receives
    assert finding.values["lease_max_attempts"] == 5


def test_sqs_check_finds_a_queue_that_hides_messages_for_less_than_the_first_extension(sqs_url, sqlite_store):

    prefix = unique_prefix().replace("_", "-")
    sqs_queue(sqs_url, f"{prefix}celery", 30, None)  # an existing queue keeps its own 30 s
    app = make_app(sqs_url, broker_transport_options={"region": "us-east-1", "is_secure": False,
                                                      "queue_name_prefix": prefix, "visibility_timeout": 600})
    ctx = Context(app, app_config(app), baseline_store(sqlite_store))
    error = sqs_finding(ctx, level="error")
    assert error.code == "sqs_queue"
    assert error.values["refresh_every"] == 150.0 and error.values["queue_visibility_timeout"] == 30.0
    assert error.fix == (f"set {VT} to the queue's VisibilityTimeout (30), or raise the queue's "
                         "VisibilityTimeout above 150s")


def test_sqs_check_names_a_job_that_outlives_the_12_hour_visibility_ceiling(sqlite_store):

    app = make_app("sqs://AKID:secret@127.0.0.1:9", tasks={"c.work": {"time_limit": 30},
                                                           "c.nightly": {"lease_max_runtime": 50000.0}},
                   broker_transport_options={"is_secure": False})
    ctx = Context(app, app_config(app), baseline_store(sqlite_store))
    finding = sqs_finding(ctx, "sqs_visibility_ceiling")
    assert finding.level == "warning"
    assert finding.values["task"] == "c.nightly" and finding.values["ceiling"] == 43200.0
    assert finding.why.startswith("task c.nightly may run 50000s, past SQS's 12-hour visibility ceiling")
    ok = make_app("sqs://AKID:secret@127.0.0.1:9", broker_transport_options={"is_secure": False})
    finding = sqs_finding(Context(ok, app_config(ok), baseline_store(sqlite_store)), "sqs_visibility_ceiling")
    assert finding.level == "ok"


def test_every_finding_has_a_severity_that_its_dict_shows_as_the_plain_word(sqlite_store):
    findings = run_checks(make_app(), baseline_store(sqlite_store))
    assert findings and all(type(f.level) is Severity for f in findings)
    assert {type(f.as_dict()["level"]) for f in findings} == {str}
    values = {"lease_on_lost": OnLost.RAISE, "seen": [OnLost.FLAG]}
    shown = Finding(Severity.WARNING, "x", (), values, "why").as_dict()
    assert shown["level"] == "warning" and shown["values"] == {"lease_on_lost": "raise", "seen": ["flag"]}
    assert repr(shown["values"]) == "{'lease_on_lost': 'raise', 'seen': ['flag']}"  # as `lease check` prints


def test_lease_check_reports_the_same_p99_as_lease_tune_for_a_tasks_runs(sqlite_store):
    # Ten runs of 1-10 s and one of 100 s: nearest rank would say 100 s, interpolation 91 s.
    for seconds in [*range(1, 11), 100]:
        run_job(sqlite_store, seconds=float(seconds))
    app = make_app()

    findings = run_checks(app, sqlite_store)
    [measured] = [f.values["measured"] for f in findings if f.code == "durations_measured"]
    [tuned] = tune(app, sqlite_store, "c.work")

    assert measured["c.work"]["p99"] == tuned.runtime_p99 == pytest.approx(91.0, abs=0.01)
    assert measured["c.work"]["p50"] == tuned.runtime_p50 and measured["c.work"]["p95"] == tuned.runtime_p95


def test_store_facts_on_every_store(store):
    """The two statements the checks and the visibility step add to the store, on each database."""
    run_job(store, key=None)
    run_job(store, name="c.other", status="failed")
    pending = run_job(store, status="pending", delay=90.0)
    live = unique_prefix()
    store.publishes.record(live, "c.work", "celery", None, 5)
    store.jobs.claim(live, "w1@h:1", "tok",
                     ClaimTerms(duration=60.0, grace=0.0, max_attempts=5, max_expirations=3, takeover=False),
                     task_name="c.work", queue="celery", payload=lambda: None)
    store.workers.touch_worker("w1@h:1", "w1@h", 1)
    facts = store.reports.check_facts()
    assert facts["missing_tables"] == [] and facts["hosts"] == ["w1@h"]
    work, other = facts["tasks"]["c.work"], facts["tasks"]["c.other"]
    assert (work["jobs"], work["keyed"], work["failed"]) == (3, 1, 0)
    assert work["longest_delay"] == pytest.approx(90.0, abs=1.0)
    assert (other["jobs"], other["keyed"], other["failed"]) == (1, 1, 1)
    assert store.deliveries.leases_alive([live, pending, "nope"]) == {live: "w1@h:1"}


def test_consumer_timeouts_come_from_the_management_api_per_queue():
    """The management plugin is not enabled on this machine: a local HTTP server answers as it would."""
    import http.server
    import threading

    from celery_lease.ops.broker_checks import rabbitmq_consumer_timeouts

    replies = {"/api/queues/%2F/q1": {"arguments": {"x-consumer-timeout": 60000}},
               "/api/queues/%2F/q2": {"effective_policy_definition": {"consumer-timeout": 120000}},
               "/api/queues/%2F/q3": {"arguments": {}}}
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.headers["Authorization"])
            body = replies.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body or {"error": "Object Not Found"}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        app = make_app(AMQP)
        timeouts = rabbitmq_consumer_timeouts(app, ["q1", "q2", "q3", "missing"], 900.0,
                                              port=server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    assert timeouts == {"q1": (60.0, "management API"), "q2": (120.0, "management API"),
                        "q3": (900.0, "lease_rabbitmq_consumer_timeout"),
                        "missing": (900.0, "lease_rabbitmq_consumer_timeout")}
    assert set(seen) == {"Basic Z3Vlc3Q6Z3Vlc3Q="}  # the broker's credentials, guest:guest


@pytest.mark.parametrize(("options", "level", "setting", "limit"), [
    ({"time_limit": 60, "soft_time_limit": 30}, "warning", "soft_time_limit", 30.0),
    ({"time_limit": 60, "lease_max_runtime": 60.0}, None, None, None),  # the same as the time limit
    ({"lease_max_runtime": 40.0}, "error", "lease_max_runtime", 40.0),
], ids=["soft-limit", "max-runtime-from-time-limit", "max-runtime-set"])
def test_every_limit_is_compared_with_the_measured_p99(sqlite_store, options, level, setting, limit):
    store = baseline_store(sqlite_store)
    for _ in range(3):
        run_job(store, seconds=45.0)
    found = [f for f in run_checks(make_app(tasks={"c.work": options}), store) if f.code == "timeout_vs_p99"]
    if level is None:
        assert [f.level for f in found] == ["ok"]
        return
    assert [(f.level, f.settings, f.values) for f in found] == [
        (level, (setting,), {"task": "c.work", setting: limit, "p99": 45.0})]
    assert found[0].fix == f"raise {setting} above the p99 (45s) with room for the tail, or split the task"


def test_the_pool_live_workers_record_is_judged_not_the_apps_setting(sqlite_store):
    store = baseline_store(sqlite_store)
    store.workers.worker_pool = ("threads", 8)  # a live worker that started with -P threads
    store.workers.touch_worker("w2@host:2", "w2@host", 2)
    app = make_app(worker_pool="prefork", tasks={"c.work": {"time_limit": 60}})

    (finding,) = [f for f in run_checks(app, store) if f.code == "runtime_limit_unenforced"]

    assert finding.level == "warning" and finding.values["worker_pool"] == "threads"
    assert not [f for f in run_checks(app, store, pool="prefork") if f.code == "runtime_limit_unenforced"]


def test_an_app_whose_task_class_is_lease_task_is_not_asked_to_measure_celerys_own_tasks(sqlite_store):
    # Celery's built-ins are LeaseTasks too in such an app, and never leased.
    app = Celery(f"checks_{unique_prefix()}", broker=REDIS, set_as_current=False,
                 task_cls="celery_lease:LeaseTask")
    app.conf.update({**BASE_CONF, "lease_store_url": "sqlite://"})
    app.task(shared=False, name="c.by_default")(plain_body)
    ctx = Context(app, app_config(app), baseline_store(sqlite_store))
    builtins = [name for name, task in app.tasks.items() if name.startswith("celery.")
                and isinstance(task, LeaseTask)]
    assert builtins and sorted(task.name for task in ctx.tasks) == ["c.by_default"]
    tuned = [t.task for t in tune(app, baseline_store(sqlite_store))]
    assert "c.by_default" in tuned and not [name for name in tuned if name.startswith("celery.")]


def test_rabbitmq_flags_a_countdown_held_past_consumer_timeout_and_passes_one_within_it(sqlite_store):
    store = baseline_store(sqlite_store)
    run_job(store, status="pending", delay=7200)  # a worker holds this message unacked for two hours

    def eta_findings(timeout: float) -> list[Finding]:
        app = make_app(broker=AMQP, lease_rabbitmq_consumer_timeout=timeout)
        return [f for f in run_checks(app, store) if f.code == "consumer_timeout_eta"]

    (cut,) = eta_findings(1800.0)
    assert cut.level == "error" and cut.values["longest_delay"] == 7200.0
    assert "running acks_late jobs included, is delivered again" in cut.why
    (within,) = eta_findings(10800.0)
    assert within.level == "ok"


def test_redis_eta_beyond_visibility_is_an_error_on_a_celery_whose_refresher_cannot_see_eta_requests(
        sqlite_store, monkeypatch):
    from celery.worker import state

    store = baseline_store(sqlite_store)
    run_job(store, status="pending", delay=7200)
    app = make_app(broker_transport_options={"visibility_timeout": 3600})
    if hasattr(state, "scheduled_requests"):  # Celery 5.7 and later: the refresher keeps ETA messages
        assert [f.level for f in run_checks(app, store) if f.code == "visibility_vs_eta"] == ["ok"]
        monkeypatch.delattr(state, "scheduled_requests")  # as on Celery 5.3-5.6
    (finding,) = [f for f in run_checks(app, store) if f.code == "visibility_vs_eta"]
    assert (finding.level, finding.settings) == ("error", (VT,))
    assert finding.values["lease_extend_visibility"] is True and finding.values["longest_delay"] == 7200.0
    assert "keeps ETA messages only from Celery 5.7" in finding.why
    assert finding.fix == "raise visibility_timeout above the longest countdown, or upgrade Celery to 5.7"
