"""``lease check`` on Celery 5.5–5.7's settings and on the Celery floor."""

from __future__ import annotations

import celery
import pytest
from celery import Celery
from celery.app.defaults import DEFAULTS
from celery.app.utils import Settings

from celery_lease import LeaseTask
from celery_lease.ops import celery_settings
from celery_lease.ops.celery_settings import FEATURES, missing_features
from celery_lease.ops.checks import run_checks
from celery_lease.store import Store
from tests.conftest import unique_prefix


def noop(self) -> None:
    return None


def make_app(**conf) -> Celery:
    app = Celery(f"settings_{unique_prefix()}", broker="redis://127.0.0.1:6379/9", set_as_current=False)
    app.conf.update(lease_store_url="sqlite://", task_acks_late=True, **conf)
    app.task(base=LeaseTask, bind=True, shared=False, name="s.work")(noop)
    return app


@pytest.fixture
def findings(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'lease.sqlite3'}", unique_prefix())
    store.migrate()
    yield lambda app, code: [f for f in run_checks(app, store) if f.code == code]
    store.engine.dispose()


def test_missing_features_names_each_setting_an_older_celery_lacks_with_its_first_version():
    floor = {key: value for key, value in DEFAULTS.items()
             if key not in {setting for setting, _, _ in FEATURES}}  # Celery 5.3 knows none of them
    assert missing_features(floor) == {setting: first for setting, _, first in FEATURES}
    newer = missing_features({**floor, "worker_soft_shutdown_timeout": 0.0})
    assert "worker_soft_shutdown_timeout" not in newer and newer["task_retry_on_worker_lost"] == "5.7"


def test_a_feature_the_app_sets_on_a_celery_without_it_is_a_warning(findings, monkeypatch):
    older = {k: v for k, v in DEFAULTS.items() if k != "task_retry_on_worker_lost"}
    monkeypatch.setattr(celery_settings, "DEFAULTS", older)
    monkeypatch.setattr(celery_settings, "missing_features", lambda: missing_features(older))
    [finding] = findings(make_app(task_retry_on_worker_lost=True), "celery_features")
    assert finding.level == "warning" and finding.values["ignored"] == {"task_retry_on_worker_lost": "5.7"}
    assert "the app sets it and nothing happens" in finding.why


def test_a_feature_the_app_sets_to_false_on_a_celery_without_it_is_a_warning(findings, monkeypatch):
    split = ("task_acks_on_timeout", "task_acks_on_failure")
    older = {k: v for k, v in DEFAULTS.items() if k not in split}  # Celery 5.6 has only the combined one
    monkeypatch.setattr(celery_settings, "DEFAULTS", older)
    monkeypatch.setattr(celery_settings, "missing_features", lambda: missing_features(older))
    [finding] = findings(make_app(task_acks_on_timeout=False, task_acks_on_failure=False), "celery_features")
    assert finding.level == "warning"
    assert finding.values["ignored"] == {"task_acks_on_failure": "5.7", "task_acks_on_timeout": "5.7"}
    [unset] = findings(make_app(), "celery_features")
    assert unset.level == "ok" and "the app sets none of them" in unset.why


def test_a_feature_set_under_the_apps_namespace_on_a_celery_without_it_is_a_warning(findings, monkeypatch):
    # A Django project's CELERY_TASK_ACKS_ON_TIMEOUT = False (config_from_object(namespace="CELERY")), on a
    # Celery before 5.7, whose value_set_for() did not read a namespace.
    split = ("task_acks_on_timeout", "task_acks_on_failure")
    older = {k: v for k, v in DEFAULTS.items() if k not in split}
    monkeypatch.setattr(celery_settings, "DEFAULTS", older)
    monkeypatch.setattr(celery_settings, "missing_features", lambda: missing_features(older))
    monkeypatch.setattr(Settings, "value_set_for", lambda self, key: key in self.without_defaults())
    app = make_app()
    app.config_from_object({"CELERY_TASK_ACKS_ON_TIMEOUT": False}, namespace="CELERY")
    [finding] = findings(app, "celery_features")
    assert finding.level == "warning" and finding.values["ignored"] == {"task_acks_on_timeout": "5.7"}


def test_the_installed_celery_is_named_with_what_it_lacks(findings):
    [finding] = findings(make_app(), "celery_features")
    assert finding.level == "ok" and finding.values["celery"] == celery.__version__
    assert finding.values["missing"] == missing_features()


@pytest.mark.skipif("task_retry_on_worker_lost" in missing_features(), reason=(
    f"task_retry_on_worker_lost first exists in Celery 5.7; installed: {celery.__version__}"))
def test_retry_on_worker_lost_is_said_to_be_the_leases_requeue(findings):
    assert findings(make_app(), "retry_on_worker_lost") == []
    [finding] = findings(make_app(task_retry_on_worker_lost=True), "retry_on_worker_lost")
    assert finding.level == "ok" and finding.values["tasks"] == ["s.work"]
    assert "max_retries does not bound it" in finding.why


def test_acks_on_timeout_off_is_said_to_requeue_through_the_lease(findings):
    assert findings(make_app(), "acks_on_timeout") == []
    # Celery before 5.7 has only the setting that 5.7 splits.
    setting = ("task_acks_on_timeout" if "task_acks_on_timeout" in DEFAULTS
               else "task_acks_on_failure_or_timeout")
    [finding] = findings(make_app(**{setting: False}), "acks_on_timeout")
    assert finding.values == {"tasks": ["s.work"]} and "dead-lettered instead of looping" in finding.why
