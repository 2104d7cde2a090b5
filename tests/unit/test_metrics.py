"""celery_lease.metrics over a populated store (SQLite, PostgreSQL), and the alert rules that use it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from prometheus_client import CollectorRegistry

from celery_lease.metrics import WINDOW, LeaseCollector
from celery_lease.store import Store
from tests.apps import ops_app
from tests.conftest import require_service, service_url, unique_prefix

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "celery_lease" / "contrib" / "prometheus" / "alerts.yml"
PLAYBOOK = ROOT / "README.md"
METRIC = re.compile(r"\bcelery_lease_[a-z0-9_]+\b")


@pytest.fixture(params=["sqlite", "postgres"])
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


def test_heartbeat_lag_histogram_counts_running_jobs_per_bucket(scene):
    app, store, _ = scene
    scrape = samples(LeaseCollector(app, store))
    quick = {"queue": "celery", "task": "ops.quick"}
    bucket = "celery_lease_heartbeat_lag_seconds_bucket"
    assert value(scrape, bucket, le="5.0", **quick) == 0
    assert value(scrape, bucket, le="60.0", **quick) == 1  # alive-expired, 7 s behind
    assert value(scrape, bucket, le="120.0", **quick) == 4  # and the three abandoned ones
    assert value(scrape, bucket, le="+Inf", **quick) == 4
    assert value(scrape, "celery_lease_heartbeat_lag_seconds_gcount", **quick) == 4
    assert value(scrape, bucket, le="5.0", queue="reports", task="ops.slow") == 2


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
def test_runtime_and_attempts_histograms_per_task(scene):
    app, store, _ = scene
    scrape = samples(LeaseCollector(app, store))
    runtime = "celery_lease_task_runtime_seconds_bucket"
    assert value(scrape, runtime, le="1.0", task="ops.quick") == 10
    assert value(scrape, runtime, le="2.5", task="ops.quick") == 25
    assert value(scrape, runtime, le="+Inf", task="ops.quick") == 40
    assert value(scrape, "celery_lease_task_runtime_seconds_gsum", task="ops.quick") == pytest.approx(82.0)
    assert value(scrape, runtime, le="10.0", task="ops.slow") == 1
    assert value(scrape, runtime, le="30.0", task="ops.slow") == 20
    attempts = "celery_lease_attempts_bucket"
    assert value(scrape, attempts, le="1.0", task="ops.slow") == 16
    assert value(scrape, attempts, le="2.0", task="ops.slow") == 20
    assert value(scrape, attempts, le="+Inf", task="ops.fails") == 2  # failed jobs count too


def test_finished_histograms_cover_the_recent_window_only(scene):
    app, store, ids = scene
    j = store.t.jobs
    slow = [job_id for job_id in ids["completed"] if "ops.slow" in job_id]
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id.in_(slow)).values(updated_at=store.now_sql - 2 * WINDOW))
    scrape = samples(LeaseCollector(app, store))
    assert ("celery_lease_task_runtime_seconds_bucket", (("le", "+Inf"), ("task", "ops.slow"))) not in scrape
    assert value(scrape, "celery_lease_task_runtime_seconds_gcount", task="ops.quick") == 40


def test_finished_histograms_read_at_most_the_row_limit(scene):
    app, store, _ = scene
    scrape = samples(LeaseCollector(app, store, limit=10))
    counts = [v for (name, _), v in scrape.items() if name == "celery_lease_task_runtime_seconds_gcount"]
    assert sum(counts) == 10


# -- counters from the audit log ----------------------------------------------------------
def test_event_counters_count_each_new_event_once(scene):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=0.0)
    first = samples(collector)
    assert value(first, "celery_lease_reaped_total") == 0  # history before the exporter started
    for _ in range(3):
        store.event("abandoned-0", "reaped_expired_lease", "lease expired")
    store.event("live-0", "stale_effect_rejected", "lock token no longer matches")
    store.event("failed-0", "failed", "ValueError: boom")
    store.event("pending-0", "redispatched", "message lost")
    second = samples(collector)
    assert value(second, "celery_lease_reaped_total") == 3
    assert value(second, "celery_lease_stale_writes_rejected_total", write="effect") == 1
    assert value(second, "celery_lease_stale_writes_rejected_total", write="completion") == 0
    assert value(second, "celery_lease_dead_lettered_total", cause="task_failure") == 1
    assert value(second, "celery_lease_redispatched_total") == 1
    third = samples(collector)
    assert value(third, "celery_lease_reaped_total") == 3


def test_event_counters_wait_for_the_lag(scene):
    app, store, _ = scene
    collector = LeaseCollector(app, store, event_lag=3600.0)
    samples(collector)
    store.event("abandoned-0", "reaped_expired_lease", "lease expired")
    assert value(samples(collector), "celery_lease_reaped_total") == 0


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
            "import celery_lease.cli, celery_lease.metrics as m\n"
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


def test_every_alert_has_an_expression_a_severity_and_a_runbook_step():
    found = rules()
    assert {r["alert"] for r in found} >= {
        "CeleryLeaseHeartbeatLag", "CeleryLeaseOldestRunningAboveP99", "CeleryLeaseReaperBusy",
        "CeleryLeaseDuplicateDeliveriesRising", "CeleryLeaseStaleWritesRejected",
        "CeleryLeasePendingPilingUp", "CeleryLeaseDeadLetters"}
    playbook = anchors(PLAYBOOK.read_text())
    readme = ROOT / "README.md"
    merged = readme.exists() and "## Operator's playbook" in readme.read_text()
    for rule in found:
        assert rule["expr"].strip() and rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "README.md" and anchor in playbook, (rule["alert"], anchor)
        if merged:
            assert anchor in anchors(readme.read_text()), (rule["alert"], anchor)


def test_alert_expressions_name_only_metrics_the_collector_exports(scene):
    app, store, _ = scene
    exported = {name for name, _ in samples(LeaseCollector(app, store))}
    for rule in rules():
        used = set(METRIC.findall(rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)


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
      - {series: 'celery_lease_heartbeat_lag_seconds_gcount{queue="celery",task="ops.quick"}', values: '3x20'}
      - {series: 'celery_lease_heartbeat_lag_seconds_bucket{le="30.0",queue="celery",task="ops.quick"}',
         values: '1x20'}
      - {series: 'celery_lease_heartbeat_lag_seconds_gcount{queue="q3",task="t3"}', values: '2x20'}
      - {series: 'celery_lease_heartbeat_lag_seconds_bucket{le="30",queue="q3",task="t3"}', values: '2x20'}
      - {series: 'celery_lease_oldest_running_seconds{queue="celery",task="ops.slow"}', values: '600+60x20'}
      - {series: 'celery_lease_oldest_running_seconds{queue="celery",task="ops.quick"}', values: '30x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="10.0",task="ops.slow"}', values: '0x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="30.0",task="ops.slow"}', values: '20x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="+Inf",task="ops.slow"}', values: '20x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="1.0",task="ops.quick"}', values: '9x20'}
      - {series: 'celery_lease_task_runtime_seconds_bucket{le="+Inf",task="ops.quick"}', values: '10x20'}
      - {series: 'celery_lease_reaped_total', values: '0+30x20'}
      - {series: 'celery_lease_dead_lettered_total{cause="task_failure"}', values: '0 0 2 2 2'}
      - {series: 'celery_lease_stale_writes_rejected_total{write="completion"}', values: '0 0 1 1 1'}
      - {series: 'celery_lease_store_up', values: '0x10'}
    alert_rule_test:
      - {eval_time: 7m, alertname: CeleryLeaseExpiredLeasesNotReaped, exp_alerts: [
          {exp_labels: {severity: critical, queue: celery, task: ops.quick}}]}
      - {eval_time: 7m, alertname: CeleryLeaseHeartbeatLag, exp_alerts: [
          {exp_labels: {severity: warning, queue: celery, task: ops.quick}}]}
      - {eval_time: 12m, alertname: CeleryLeaseOldestRunningAboveP99, exp_alerts: [
          {exp_labels: {severity: warning, task: ops.slow}}]}
      - {eval_time: 12m, alertname: CeleryLeaseReaperBusy, exp_alerts: [{exp_labels: {severity: warning}}]}
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
      - {series: 'celery_lease_duplicate_deliveries_skipped_total', values: '0+5x40'}
      - {series: 'celery_lease_scrape_duration_seconds', values: '3x40'}
    alert_rule_test:
      - {eval_time: 30m, alertname: CeleryLeasePendingPilingUp, exp_alerts: [
          {exp_labels: {severity: warning, queue: reports}}]}
      - {eval_time: 25m, alertname: CeleryLeaseDuplicateDeliveriesRising, exp_alerts: [
          {exp_labels: {severity: warning}}]}
      - {eval_time: 12m, alertname: CeleryLeaseScrapeSlow, exp_alerts: [{exp_labels: {severity: warning}}]}
  - interval: 1m
    input_series:
      - {series: 'celery_lease_oldest_pending_seconds{queue="reports"}', values: '400+60x40'}
      - {series: 'celery_lease_pending_jobs{queue="reports"}', values: '10+5x40'}
      - {series: 'celery_lease_workers_alive', values: '0x40'}
    alert_rule_test:
      - {eval_time: 30m, alertname: CeleryLeasePendingPilingUp, exp_alerts: []}
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
