"""celery_lease.ops.metrics over a populated store (SQLite, PostgreSQL), and the alert rules that use it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from prometheus_client import CollectorRegistry

from celery_lease.config import RUNBOOK_BASE_URL
from celery_lease.contrib.prometheus import rules as render_rules
from celery_lease.errors import StoreUnavailable
from celery_lease.ops.metrics import LeaseCollector, metric_names
from celery_lease.store import Store
from tests.apps import ops_app
from tests.conftest import SCENE_STORES, require_service, service_url, unique_prefix

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "celery_lease" / "contrib" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "celery_lease" / "contrib" / "grafana" / "celery_lease.json"
PLAYBOOK = ROOT / "docs" / "operators.md"
METRIC = re.compile(r"\bcelery_lease_[a-z0-9_]+\b")


@pytest.fixture(params=SCENE_STORES)
def scene(request, tmp_path) -> Iterator[tuple[Any, Store, dict[str, list[str]]]]:
    """An app and a store holding ops_app's scene (fresh per test: lags and ages are measured)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    else:
        url = require_service("PostgreSQL", service_url("postgres"))
    app = ops_app.build(url, unique_prefix(), "memory://")
    store = Store(url, app.conf.lease_table_prefix)
    store.migrate()
    try:
        yield app, store, ops_app.populate(store)
    finally:
        store.t.metadata.drop_all(store.engine)
        store.engine.dispose()


def samples(collector: LeaseCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One scrape as {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in collector.collect() for s in family.samples}


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape[(name, tuple(sorted(labels.items())))]


# -- gauges ---------------------------------------------------------------------------
def test_running_jobs_expired_leases_and_oldest_age_per_queue_and_task(scene):
    app, store, _ = scene
    scrape = samples(LeaseCollector(app, store))
    quick, slow = {"queue": "celery", "task": "ops.quick"}, {"queue": "reports", "task": "ops.slow"}
    assert value(scrape, "celery_lease_running_jobs", **quick) == 4
    assert value(scrape, "celery_lease_running_jobs", **slow) == 2
    assert value(scrape, "celery_lease_running_expired_jobs", **quick) == 4
    assert value(scrape, "celery_lease_running_expired_jobs", **slow) == 0
    assert 200 <= value(scrape, "celery_lease_oldest_running_seconds", **quick) < 230
    assert 30 <= value(scrape, "celery_lease_oldest_running_seconds", **slow) < 60
    assert 104 <= value(scrape, "celery_lease_heartbeat_lag_max_seconds", **quick) < 130


def test_heartbeat_lag_histogram_counts_each_running_job_once_per_scrape(scene):
    app, store, jobs = scene
    collector = LeaseCollector(app, store)
    ops_app.heartbeat(store, jobs["live"])  # filling the scene may take seconds on a busy machine
    scrape = samples(collector)
    quick = {"queue": "celery", "task": "ops.quick"}
    bucket = "celery_lease_heartbeat_lag_seconds_bucket"
    assert value(scrape, bucket, le="5.0", **quick) == 0
    assert value(scrape, bucket, le="60.0", **quick) == 1  # alive-expired, 7 s behind
    assert value(scrape, bucket, le="120.0", **quick) == 4  # and the three abandoned ones
    assert value(scrape, bucket, le="+Inf", **quick) == 4
    assert value(scrape, "celery_lease_heartbeat_lag_seconds_count", **quick) == 4
    assert 300 < value(scrape, "celery_lease_heartbeat_lag_seconds_sum", **quick) < 400
    assert value(scrape, bucket, le="5.0", queue="reports", task="ops.slow") == 2
    again = samples(collector)
    assert value(again, "celery_lease_heartbeat_lag_seconds_count", **quick) == 8  # cumulative


def test_pending_depth_and_oldest_due_age_per_queue(scene):
    app, store, _ = scene
    scrape = samples(LeaseCollector(app, store))
    assert value(scrape, "celery_lease_pending_jobs", queue="celery") == 3
    assert value(scrape, "celery_lease_pending_jobs", queue="reports") == 1
    assert 100 <= value(scrape, "celery_lease_oldest_pending_seconds", queue="reports") < 130
    assert value(scrape, "celery_lease_oldest_pending_seconds", queue="celery") < 30


def test_workers_alive_and_stale(scene):
    app, store, _ = scene
    scrape = samples(LeaseCollector(app, store))
    assert value(scrape, "celery_lease_workers_alive") == 1
    assert value(scrape, "celery_lease_workers_stale") == 1


# -- histograms of finished jobs -----------------------------------------------------
def finish(store: Store, task: str, runtimes: list[float], attempts: int = 1, fail: bool = False) -> None:
    """Jobs of ``task`` on ``celery`` that finish now after the given runtimes."""
    for runtime in runtimes:
        job_id = f"later-{task}-{uuid.uuid4().hex[:8]}"
        store.publishes.record(job_id, task, "celery", None, 3)
        token = ops_app._claim(store, job_id, task, "celery", ops_app.ALIVE)
        if fail:
            store.jobs.fail(job_id, token, "ValueError: boom", ops_app.ALIVE)
        else:
            store.jobs.complete(job_id, token, ops_app.ALIVE)
        done = store.get(job_id).updated_at
        ops_app._set(store, job_id, started_at=done - runtime, attempt_count=attempts)


def test_runtime_and_attempts_histograms_count_what_finished_since_the_exporter_started(scene):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=0.0)
    first = samples(collector)
    assert not any(name.startswith("celery_lease_task_runtime") for name, _ in first)  # history
    finish(store, "ops.quick", [0.2, 0.7, 2.0, 4.0])
    finish(store, "ops.slow", [20.0, 25.0], attempts=2)
    finish(store, "ops.fails", [1.0], attempts=3, fail=True)
    second = samples(collector)
    quick, slow = {"queue": "celery", "task": "ops.quick"}, {"queue": "celery", "task": "ops.slow"}
    runtime = "celery_lease_task_runtime_seconds_bucket"
    assert value(second, runtime, le="0.25", **quick) == 1
    assert value(second, runtime, le="1.0", **quick) == 2
    assert value(second, runtime, le="5.0", **quick) == 4
    assert value(second, runtime, le="+Inf", **quick) == 4
    assert value(second, "celery_lease_task_runtime_seconds_count", **quick) == 4
    assert value(second, "celery_lease_task_runtime_seconds_sum", **quick) == pytest.approx(6.9, abs=0.01)
    assert value(second, runtime, le="10.0", **slow) == 0 and value(second, runtime, le="30.0", **slow) == 2
    attempts = "celery_lease_task_attempts_bucket"
    assert value(second, attempts, le="1.0", **slow) == 0 and value(second, attempts, le="2.0", **slow) == 2
    assert value(second, attempts, le="3.0", queue="celery", task="ops.fails") == 1  # failed jobs count
    fails = ("celery_lease_task_runtime_seconds_count", (("queue", "celery"), ("task", "ops.fails")))
    assert fails not in second  # a failure has no runtime
    third = samples(collector)  # nothing new finished: the same totals, not counted twice
    assert value(third, "celery_lease_task_runtime_seconds_count", **quick) == 4
    finish(store, "ops.quick", [0.1])
    assert value(samples(collector), "celery_lease_task_runtime_seconds_count", **quick) == 5


def test_histograms_are_cumulative_and_consistent(scene):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=0.0)
    samples(collector)
    finish(store, "ops.quick", [0.1 * i for i in range(1, 30)])
    scrape = samples(collector)
    for name in ("celery_lease_task_runtime_seconds", "celery_lease_task_attempts",
                 "celery_lease_heartbeat_lag_seconds"):
        series = {labels for (sample, labels) in scrape if sample == f"{name}_count"}
        assert series, name
        for labels in series:
            buckets = sorted((float(dict(lb)["le"]), v) for (sample, lb), v in scrape.items()
                             if sample == f"{name}_bucket"
                             and tuple(kv for kv in lb if kv[0] != "le") == labels)
            counts = [v for _, v in buckets]
            assert counts == sorted(counts), (name, labels)  # cumulative: never decreasing
            assert counts[-1] == scrape[(f"{name}_count", labels)]  # +Inf bucket == _count
            assert (f"{name}_sum", labels) in scrape


# -- counters from the audit log ----------------------------------------------------------
def test_event_counters_count_each_new_event_once_by_queue_and_task(scene):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=0.0)
    first = samples(collector)
    assert not any(name == "celery_lease_reaped_total" for name, _ in first)  # history before the start
    for _ in range(3):
        store.event("abandoned-0", "reaped_expired_lease", "lease expired")
    store.event("live-0", "stale_effect_rejected", "lock token no longer matches")
    store.event("failed-0", "failed", "ValueError: boom")
    store.event("pending-0", "redispatched", "message lost")
    store.event(None, "duplicate_delivery_skipped", "no job known to the writer")
    second = samples(collector)
    quick = {"queue": "celery", "task": "ops.quick"}
    assert value(second, "celery_lease_reaped_total", **quick) == 3
    assert value(second, "celery_lease_stale_writes_rejected_total", queue="reports", task="ops.slow",
                 write="effect") == 1
    assert value(second, "celery_lease_dead_lettered_total", queue="celery", task="ops.fails",
                 cause="task_failure") == 1
    assert value(second, "celery_lease_redispatched_total", **quick) == 1
    assert value(second, "celery_lease_duplicate_deliveries_skipped_total", queue="unknown",
                 task="unknown") == 1
    third = samples(collector)
    assert value(third, "celery_lease_reaped_total", **quick) == 3


def test_a_heartbeat_ahead_of_the_scrapes_clock_adds_no_negative_lag(scene):
    # A heartbeat committed after the scrape read its clock (or a clock stepped back): the lag histogram's
    # sum is a counter, and a drop would read as a reset.
    app, store, jobs = scene
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id.in_(jobs["live"])).values(last_heartbeat_at=store.now_sql + 30))
    collector = LeaseCollector(app, store)
    slow = {"queue": "reports", "task": "ops.slow"}
    sums = [value(samples(collector), "celery_lease_heartbeat_lag_seconds_sum", **slow) for _ in range(2)]
    assert sums == [0.0, 0.0]
    assert value(samples(collector), "celery_lease_heartbeat_lag_seconds_count", **slow) == 6


def test_the_running_gauges_are_capped_like_the_histograms_and_the_rest_add_up_as_other(scene):
    app, store, _ = scene
    scrape = samples(LeaseCollector(app, store, max_series=1))
    running = {labels: v for (name, labels), v in scrape.items() if name == "celery_lease_running_jobs"}
    assert sorted(running.values()) == [2, 4] and len(running) == 2
    assert (("queue", "other"), ("task", "other")) in running
    for gauge in ("celery_lease_running_expired_jobs", "celery_lease_oldest_running_seconds",
                  "celery_lease_heartbeat_lag_max_seconds"):
        assert {labels for (name, labels), _ in scrape.items() if name == gauge} == set(running), gauge


def test_a_job_with_no_queue_recorded_is_labelled_unknown_by_every_gauge(scene):
    app, store, _ = scene
    store.publishes.record("no-queue", "ops.quick", None, "{}", 3)
    scrape = samples(LeaseCollector(app, store))
    assert value(scrape, "celery_lease_pending_jobs", queue="unknown") == 1
    assert ("celery_lease_pending_jobs", (("queue", ""),)) not in scrape


def test_label_pairs_are_capped_per_metric_and_the_rest_counted_as_other(scene):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=0.0, max_series=1)
    samples(collector)
    store.event("abandoned-0", "reaped_expired_lease", "lease expired")
    samples(collector)  # ops.quick on celery is the first pair seen: it keeps its labels
    store.event("live-0", "reaped_expired_lease", "lease expired")
    store.event("failed-0", "reaped_expired_lease", "lease expired")
    scrape = samples(collector)
    reaped = {labels: v for (name, labels), v in scrape.items() if name == "celery_lease_reaped_total"}
    assert reaped == {(("queue", "celery"), ("task", "ops.quick")): 1,
                      (("queue", "other"), ("task", "other")): 2}


def test_a_real_reaper_run_is_counted_by_queue_and_task_and_its_time_exported(scene):
    from celery_lease.reaper.run import Reaper

    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=0.0)
    before = samples(collector)
    assert value(before, "celery_lease_reaper_last_run_timestamp_seconds") == 0  # none recorded
    result = Reaper(app, store).run_once()
    assert result.reaped == 3, result
    after = samples(collector)
    assert value(after, "celery_lease_reaped_total", queue="celery", task="ops.quick") == 3
    last = value(after, "celery_lease_reaper_last_run_timestamp_seconds")
    assert last == pytest.approx(store.now(), abs=30)
    assert value(after, "celery_lease_reaper_last_run_duration_seconds") >= 0


def test_each_scrape_is_noted_in_the_store(scene):
    app, store, _ = scene
    assert store.runs.meta_age("exporter_last_scrape") == (None, None)
    samples(LeaseCollector(app, store))
    age, exporter = store.runs.meta_age("exporter_last_scrape")
    assert 0 <= age < 30 and exporter.endswith(f":{os.getpid()}")


def test_event_counters_wait_for_the_lag(scene):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=3600.0)
    samples(collector)
    store.event("abandoned-0", "reaped_expired_lease", "lease expired")
    assert not any(name == "celery_lease_reaped_total" for name, _ in samples(collector))


def test_a_scrape_whose_event_read_fails_counts_nothing_and_the_next_counts_each_job_once(scene, monkeypatch):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=0.0)
    samples(collector)
    finish(store, "ops.quick", [0.2, 0.7, 2.0, 4.0])
    store.event("abandoned-0", "reaped_expired_lease", "lease expired")

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("connection reset")

    with monkeypatch.context() as patched:  # the finished jobs are read, then the events are not
        patched.setattr(store.reports, "labelled_event_counts", unavailable)
        assert value(samples(collector), "celery_lease_store_up") == 0
    after = samples(collector)
    quick = {"queue": "celery", "task": "ops.quick"}
    assert value(after, "celery_lease_task_runtime_seconds_count", **quick) == 4
    assert value(after, "celery_lease_task_runtime_seconds_sum", **quick) == pytest.approx(6.9, abs=0.01)
    assert value(after, "celery_lease_task_attempts_count", **quick) == 4
    assert value(after, "celery_lease_reaped_total", **quick) == 1
    assert value(after, "celery_lease_heartbeat_lag_seconds_count", **quick) == 8  # 4 running, 2 scrapes


# -- the exporter's own health ---------------------------------------------------------
def test_every_family_has_help_text(scene):
    app, store, _ = scene
    families = list(LeaseCollector(app, store).collect())
    assert len(families) >= 20
    assert all(f.documentation.strip() for f in families)


def test_an_unreachable_store_reports_store_up_zero_and_describe_stays_off_the_store():
    app = ops_app.build("postgresql+psycopg://postgres@127.0.0.1:1/none", unique_prefix(), "memory://")
    collector = LeaseCollector(app)
    CollectorRegistry().register(collector)  # describe() only: no store round trip
    scrape = samples(collector)
    assert value(scrape, "celery_lease_store_up") == 0
    assert ("celery_lease_scrape_duration_seconds", ()) in scrape
    assert not any(name == "celery_lease_running_jobs" for name, _ in scrape)


def test_importing_metrics_needs_no_prometheus_client_until_used():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "import celery_lease.cli, celery_lease.ops.metrics as m\n"
            "try:\n    m.prometheus()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "pip install celery-lease[metrics]" in out.stdout


def test_a_scrape_uses_indexes_for_every_read_of_jobs_and_events(tmp_path):
    # SQLite's planner says SEARCH for an index range, SCAN for a walk of a whole table or index.
    url = f"sqlite:///{tmp_path / 'plan.sqlite3'}"
    app = ops_app.build(url, unique_prefix(), "memory://")
    store = Store(url, app.conf.lease_table_prefix)
    store.migrate()
    ops_app.populate(store)
    collector = LeaseCollector(app, store, event_lag=0.0)
    samples(collector)
    statements: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", capture)
    samples(collector)
    sa.event.remove(store.engine, "before_cursor_execute", capture)
    tables = (store.t.jobs.name, store.t.events.name)
    assert sum(1 for s, _ in statements if any(t in s for t in tables)) >= 5
    with store.engine.connect() as c:
        for statement, parameters in statements:
            plan = [row[-1] for row in c.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)]
            for line in plan:
                for table in tables:
                    assert not re.match(rf"SCAN {table}\b", line), (statement, plan)
    store.engine.dispose()


# -- alert rules ----------------------------------------------------------------------------
def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {slug(line.lstrip("#")) for line in markdown.splitlines() if line.startswith("#")}


def test_every_alert_has_an_expression_a_severity_and_an_absolute_runbook_url():
    found = rules()
    assert {r["alert"] for r in found} >= {
        "CeleryLeaseHeartbeatLag", "CeleryLeaseOldestRunningAboveP99", "CeleryLeaseReaperBusy",
        "CeleryLeaseDuplicateDeliveriesRising", "CeleryLeaseStaleWritesRejected",
        "CeleryLeasePendingPilingUp", "CeleryLeaseDeadLetters", "CeleryLeaseReaperNotRunning",
        "CeleryLeaseExporterDown"}
    playbook = anchors(PLAYBOOK.read_text())
    for rule in found:
        assert rule["expr"].strip() and rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert page == RUNBOOK_BASE_URL and anchor in playbook, (rule["alert"], anchor)


def test_runbook_urls_follow_the_configured_base():
    app = ops_app.build("sqlite://", unique_prefix(), "memory://")
    app.conf.lease_runbook_base_url = "https://wiki.example.org/ops/celery-lease"
    from celery_lease.contrib.prometheus import alert_rules

    rendered = [r for g in yaml.safe_load(alert_rules(app))["groups"] for r in g["rules"]]
    assert [r["annotations"]["runbook_url"].partition("#")[2] for r in rendered] == [
        r["annotations"]["runbook_url"].partition("#")[2] for r in rules()]
    assert all(r["annotations"]["runbook_url"].startswith("https://wiki.example.org/ops/celery-lease#")
               for r in rendered)
    assert render_rules() == ALERTS.read_text()


def test_the_exporter_going_away_is_an_alert_of_its_own():
    (rule,) = [r for r in rules() if r["alert"] == "CeleryLeaseExporterDown"]
    assert rule["expr"].strip().startswith("absent(")


def exported_names(app: Any, store: Store) -> set[str]:
    """Every sample name the collector can emit, whether or not it holds a sample now."""
    collector = LeaseCollector(app, store)
    return metric_names(collector.describe()) | {name for name, _ in samples(collector)}


def test_alert_expressions_name_only_metrics_the_collector_exports(scene):
    app, store, _ = scene
    exported = exported_names(app, store)
    for rule in rules():
        used = set(METRIC.findall(rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)


def test_every_grafana_panel_queries_only_metrics_the_collector_exports(scene):
    app, store, _ = scene
    exported = exported_names(app, store)
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            used = set(METRIC.findall(expr))
            assert used, (panel["title"], expr)
            assert used <= exported, (panel["title"], used - exported)


def test_the_grafana_dashboard_ships_as_package_data():
    assert "contrib/grafana/*.json" in (ROOT / "setup.cfg").read_text()


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool not installed (apt-get install prometheus)")


@needs_promtool
def test_alert_rules_pass_promtool():
    result = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


PROMTOOL_TESTS = """
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - {series: 'celery_lease_running_expired_jobs{queue="celery",task="ops.quick"}', values: '1x20'}
      - {series: 'celery_lease_running_expired_jobs{queue="celery",task="ops.slow"}', values: '1 1 0x20'}
      - {series: 'celery_lease_heartbeat_lag_max_seconds{queue="celery",task="ops.quick"}', values: '90x20'}
      - {series: 'celery_lease_heartbeat_lag_max_seconds{queue="q3",task="t3"}', values: '12x20'}
      - {series: 'celery_lease_oldest_running_seconds{queue="celery",task="ops.slow"}', values: '600+60x20'}
      - {series: 'celery_lease_oldest_running_seconds{queue="celery",task="ops.quick"}', values: '30x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="10.0",queue="celery",task="ops.slow"}',
         values: '0x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="30.0",queue="celery",task="ops.slow"}',
         values: '0+20x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="+Inf",queue="celery",task="ops.slow"}',
         values: '0+20x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="1.0",queue="celery",task="ops.quick"}',
         values: '0+9x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="+Inf",queue="celery",task="ops.quick"}',
         values: '0+10x20'}
      - {series: 'celery_lease_reaped_total{queue="celery",task="ops.quick"}', values: '0+30x20'}
      - {series: 'celery_lease_dead_lettered_total{cause="task_failure",queue="celery",task="ops.fails"}',
         values: '0 0 2 2 2'}
      - {series: 'celery_lease_stale_writes_rejected_total{write="completion",queue="celery",task="t"}',
         values: '0 0 1 1 1'}
      - {series: 'celery_lease_store_up', values: '0x10'}
    alert_rule_test:
      - {eval_time: 7m, alertname: CeleryLeaseExpiredLeasesNotReaped, exp_alerts: [
          {exp_labels: {severity: critical, queue: celery, task: ops.quick}}]}
      - {eval_time: 7m, alertname: CeleryLeaseHeartbeatLag, exp_alerts: [
          {exp_labels: {severity: warning, queue: celery, task: ops.quick}}]}
      - {eval_time: 12m, alertname: CeleryLeaseOldestRunningAboveP99, exp_alerts: [
          {exp_labels: {severity: warning, task: ops.slow}}]}
      - {eval_time: 12m, alertname: CeleryLeaseReaperBusy, exp_alerts: [
          {exp_labels: {severity: warning, queue: celery}}]}
      - {eval_time: 3m, alertname: CeleryLeaseDeadLetters, exp_alerts: [
          {exp_labels: {severity: warning, cause: task_failure}}]}
      - {eval_time: 3m, alertname: CeleryLeaseStaleWritesRejected, exp_alerts: [
          {exp_labels: {severity: warning, write: completion}}]}
      - {eval_time: 3m, alertname: CeleryLeaseStoreUnreachable, exp_alerts: [
          {exp_labels: {severity: critical}}]}
  - interval: 1m
    input_series:
      - {series: 'celery_lease_oldest_pending_seconds{queue="reports"}', values: '400+60x40'}
      - {series: 'celery_lease_pending_jobs{queue="reports"}', values: '10+5x40'}
      - {series: 'celery_lease_oldest_pending_seconds{queue="celery"}', values: '10x40'}
      - {series: 'celery_lease_pending_jobs{queue="celery"}', values: '10+5x40'}
      - {series: 'celery_lease_workers_alive', values: '2x40'}
      - {series: 'celery_lease_duplicate_deliveries_skipped_total{queue="celery",task="ops.quick"}',
         values: '0+5x40'}
      - {series: 'celery_lease_scrape_duration_seconds', values: '3x40'}
    alert_rule_test:
      - {eval_time: 30m, alertname: CeleryLeasePendingPilingUp, exp_alerts: [
          {exp_labels: {severity: warning, queue: reports}}]}
      - {eval_time: 25m, alertname: CeleryLeaseDuplicateDeliveriesRising, exp_alerts: [
          {exp_labels: {severity: warning, queue: celery}}]}
      - {eval_time: 12m, alertname: CeleryLeaseScrapeSlow, exp_alerts: [{exp_labels: {severity: warning}}]}
  - interval: 1m
    input_series:
      - {series: 'celery_lease_oldest_pending_seconds{queue="reports"}', values: '400+60x40'}
      - {series: 'celery_lease_pending_jobs{queue="reports"}', values: '10+5x40'}
      - {series: 'celery_lease_workers_alive', values: '0x40'}
    alert_rule_test:
      - {eval_time: 30m, alertname: CeleryLeasePendingPilingUp, exp_alerts: []}
  - interval: 1m
    input_series:
      # A reaper that ran every 15 s until minute 10 (epoch seconds of the test's clock), then stopped.
      - {series: 'celery_lease_reaper_last_run_timestamp_seconds', values: '0+60x10 600x30'}
      - {series: 'celery_lease_store_up', values: '1x10'}
    alert_rule_test:
      - {eval_time: 9m, alertname: CeleryLeaseReaperNotRunning, exp_alerts: []}
      - {eval_time: 18m, alertname: CeleryLeaseReaperNotRunning, exp_alerts: [
          {exp_labels: {severity: critical}}]}
      - {eval_time: 8m, alertname: CeleryLeaseExporterDown, exp_alerts: []}
      - {eval_time: 25m, alertname: CeleryLeaseExporterDown, exp_alerts: [
          {exp_labels: {severity: critical}}]}
  - interval: 1m
    input_series:
      - {series: 'celery_lease_reaper_last_run_timestamp_seconds', values: '0x20'}
    alert_rule_test:
      - {eval_time: 10m, alertname: CeleryLeaseReaperNotRunning, exp_alerts: [
          {exp_labels: {severity: critical}}]}
"""


@needs_promtool
def test_alerts_fire_on_the_series_they_are_about(tmp_path):
    # Annotations are templates promtool would compare verbatim; the rules are tested without them.
    spec = yaml.safe_load(ALERTS.read_text())
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(spec))
    tests = yaml.safe_load(PROMTOOL_TESTS)
    tests["rule_files"] = [str(tmp_path / "alerts.yml")]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
