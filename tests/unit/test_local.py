"""self.lease outside a worker: eager runs, apply() and direct calls get a working local handle."""

from __future__ import annotations

import threading

import pytest
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.errors import LockUnavailable
from celery_lease.store import for_app
from celery_lease.testing import local_leases
from celery_lease.worker.local import LocalLease
from tests.conftest import drop_app_store, migrated_store, unique_prefix


def make_app(**conf) -> Celery:
    app = Celery(f"local_{unique_prefix()}", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, **conf)
    return app


def define(app: Celery):
    @app.task(base=LeaseTask, bind=True, shared=False, name="l.charge")
    def charge(self, payment):
        lease = self.lease
        lease.check()
        lease.extend(60)
        with lease.lock(f"payment:{payment}"), lease.effect(f"charged:{payment}") as first:
            pass
        lease.checkpoint({"step": 2})
        return {"first": first, "job": lease.job_id, "state": lease.checkpoint_state,
                "key": lease.idempotency_key, "attempt": lease.attempt, "lost": lease.lost}

    return charge


def test_eager_runs_get_a_local_handle_whose_effect_is_first_once_per_key():
    app = make_app()
    charge = define(app)
    with local_leases(app) as state:
        first = charge.delay("p1").get()
        again = charge.apply(("p1",), task_id="fixed").get()
        assert first["first"] is True and again["first"] is False
        assert state.effects == {"charged:p1": first["job"]}
        assert state.checkpoints == {first["job"]: {"step": 2}, "fixed": {"step": 2}}
    assert again == {"first": False, "job": "fixed", "state": {"step": 2}, "key": "l.charge:fixed",
                     "attempt": 1, "lost": False}


def test_a_direct_call_gets_a_local_handle_and_the_helper_starts_from_nothing():
    app = make_app()
    charge = define(app)
    with local_leases(app):
        assert charge("p2")["first"] is True
        assert charge("p2")["first"] is False
    with local_leases(app) as state:
        assert state.effects == {}
        assert charge("p2")["first"] is True


def test_an_effect_whose_block_raises_is_not_kept():
    app = make_app()

    @app.task(base=LeaseTask, bind=True, shared=False, name="l.flaky")
    def flaky(self, fail):
        with self.lease.effect("mail:1") as first:
            if fail:
                raise RuntimeError("smtp down")
            return first

    with local_leases(app):
        with pytest.raises(RuntimeError):
            flaky.apply((True,)).get()
        assert flaky.apply((False,)).get() is True


def test_a_local_lock_is_exclusive_within_the_process():
    app = make_app()
    lease = LocalLease(app, "j1", "k")
    other = LocalLease(app, "j2", "k2")
    held, release = threading.Event(), threading.Event()

    def hold():
        with lease.lock("printer"):
            held.set()
            release.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    with pytest.raises(LockUnavailable), other.lock("printer", timeout=0.05):
        pass
    release.set()
    thread.join(5)
    with other.lock("printer", timeout=1):
        pass


def test_self_lease_is_none_outside_any_run():
    app = make_app()
    charge = define(app)
    assert charge.lease is None


def test_eager_runs_take_a_real_lease_when_the_store_is_set_for_them(tmp_path):
    app = make_app(lease_eager_store=True, lease_store_url=f"sqlite:///{tmp_path}/eager.db",
                   lease_table_prefix=unique_prefix())
    charge = define(app)
    migrated_store(app)
    try:
        result = charge.apply(("p3",), task_id="eager-1").get()
        again = charge.apply(("p3",), task_id="eager-2").get()
        store = for_app(app)
        assert result["first"] is True and again["first"] is False
        assert store.get("eager-1").status == "completed"
        assert store.reports.effect_keys("eager-1") == ["charged:p3"]
        assert store.get("eager-1").checkpoint_state() == {"step": 2}
    finally:
        drop_app_store(app)


@pytest.mark.slow
def test_ten_thousand_eager_runs_leave_bounded_local_state():
    app = make_app()

    @app.task(base=LeaseTask, bind=True, shared=False, name="l.each")
    def each(self, n):
        with self.lease.lock(f"order:{n}"), self.lease.effect(f"mailed:{n}") as first:
            self.lease.checkpoint({"n": n})
            return first

    with local_leases(app) as state:
        for n in range(10_000):
            assert each.apply((n,)).get() is True
        # The newest keys are still first once; the state keeps the newest 1,000 of each kind
        assert each.apply((9_999,)).get() is False
        assert len(state.effects) <= 1_000 and len(state.checkpoints) <= 1_000
        assert "mailed:9999" in state.effects and "mailed:0" not in state.effects
        assert state._locks == {}, "a lock nobody holds or waits for is dropped"
