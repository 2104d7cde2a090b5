"""`celery -A tests.apps.ops_app lease exporter` as a real process, scraped over HTTP.

The scrape is parsed with prometheus_client's own parser, and every metric that
celery_lease/contrib/prometheus/alerts.yml names must be in it.
"""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from celery_lease.ops.metrics import metric_names
from celery_lease.reaper.run import Reaper
from celery_lease.store import Store
from tests.apps import ops_app
from tests.conftest import SCENE_STORES, require_service, service_url, unique_prefix
from tests.helpers import wait_for
from tests.workers import _spawn, celery_processes

pytestmark = pytest.mark.integration

ALERTS = Path(__file__).resolve().parents[2] / "celery_lease" / "contrib" / "prometheus" / "alerts.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


@pytest.fixture(params=SCENE_STORES)
def exporter(request, tmp_path) -> Iterator[tuple[int, Store, dict, list]]:
    """A populated store and an exporter process serving it on a free port."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    else:
        url = require_service("PostgreSQL", service_url("postgres"))
    prefix = unique_prefix()
    store = Store(url, prefix)
    store.migrate()
    ids = ops_app.populate(store)
    port = free_port()
    env = {"OPS_STORE": url, "OPS_PREFIX": prefix, "OPS_BROKER": "memory://"}
    try:
        with celery_processes(tmp_path) as procs:
            procs.append(_spawn(["-A", "tests.apps.ops_app", "lease", "exporter", "--port", str(port),
                                 "--addr", "127.0.0.1"], env, tmp_path, "exporter"))
            wait_for(lambda: scrape(port) or procs[0].popen.poll() is not None, timeout=30,
                     message=f"exporter answering on port {port}")
            assert procs[0].popen.poll() is None, procs[0].output()
            yield port, store, ids, procs
    finally:
        store.t.metadata.drop_all(store.engine)
        store.engine.dispose()


def families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> {sorted labels: value}, parsed by prometheus_client."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation, family.name
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_exporter_serves_the_store_over_http(exporter):
    port, _, _, _ = exporter
    got = families(scrape(port))
    quick = (("queue", "celery"), ("task", "ops.quick"))
    assert got["celery_lease_running_expired_jobs"][quick] == 4
    assert got["celery_lease_pending_jobs"][(("queue", "reports"),)] == 1
    assert got["celery_lease_workers_alive"][()] == 1
    assert got["celery_lease_store_up"][()] == 1
    assert "celery_lease_reaped_total" not in got  # counted from the exporter's start
    assert got["celery_lease_reaper_last_run_timestamp_seconds"][()] == 0  # no run recorded yet


def consistent(got: dict, name: str) -> int:
    """Check a histogram's series (+Inf bucket == _count, buckets never decrease, _sum there); count them."""
    for labels, count in got[f"{name}_count"].items():
        assert labels in got[f"{name}_sum"], (name, labels)
        buckets = sorted((float(dict(lb)["le"]), v) for lb, v in got[f"{name}_bucket"].items()
                         if tuple(kv for kv in lb if kv[0] != "le") == labels)
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), (name, labels)
        assert buckets[-1] == (float("inf"), count), (name, labels)
    return len(got[f"{name}_count"])


def test_a_real_reaper_run_shows_as_counters_by_queue_and_task_and_consistent_histograms(exporter):
    port, store, _, _ = exporter
    app = ops_app.build(store.url, store.prefix, "memory://")
    assert Reaper(app, store).run_once().reaped == 3
    for i in range(3):
        store.publishes.record(f"after-{i}", "ops.quick", "celery", None, 3)
        token = ops_app._claim(store, f"after-{i}", "ops.quick", "celery", ops_app.ALIVE)
        store.jobs.complete(f"after-{i}", token)
    # The exporter counts rows older than its lag (5 s): poll its own scrapes until they show.
    key = (("queue", "celery"), ("task", "ops.quick"))

    def counted() -> dict | None:
        got = families(scrape(port) or "")
        done = (got.get("celery_lease_reaped_total", {}).get(key) == 3
                and got.get("celery_lease_task_runtime_seconds_count", {}).get(key) == 3)
        return got if done else None

    got = wait_for(counted, timeout=30, interval=0.5, message="reaper run and completions counted")
    assert got["celery_lease_reaped_total"][key] == 3
    assert got["celery_lease_task_runtime_seconds_count"][key] == 3
    assert got["celery_lease_task_attempts_count"][key] == 3
    assert got["celery_lease_reaper_last_run_timestamp_seconds"][()] > 0
    for name in ("celery_lease_task_runtime_seconds", "celery_lease_task_attempts",
                 "celery_lease_heartbeat_lag_seconds"):
        assert consistent(got, name) >= 1, name
    assert store.runs.meta_age("exporter_last_scrape")[0] < 30  # each scrape is noted in the store


def test_every_metric_the_alert_rules_use_is_scraped(exporter):
    port, _, _, _ = exporter
    # Every name the families expose, with or without samples now (counters count from the start).
    scraped = metric_names(text_string_to_metric_families(scrape(port)))
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    used = {name for r in rules for name in re.findall(r"\bcelery_lease_[a-z0-9_]+\b", r["expr"])}
    assert len(used) >= 10
    assert used <= scraped, used - scraped


def test_a_second_exporter_on_a_taken_port_says_so(exporter, tmp_path):
    port, store, _, procs = exporter
    env = {"OPS_STORE": store.url, "OPS_PREFIX": store.t.jobs.name[: -len("jobs")], "OPS_BROKER": "memory://"}
    second = _spawn(["-A", "tests.apps.ops_app", "lease", "exporter", "--port", str(port), "--addr",
                     "127.0.0.1"], env, tmp_path, "second")
    procs.append(second)
    assert second.popen.wait(30) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in second.output() and "--port" in second.output()
