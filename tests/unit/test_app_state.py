"""celery_lease's state on an app: one object per app, made once, where every module finds its field."""

from __future__ import annotations

import contextlib
import threading

from celery import Celery

import celery_lease.app_state as app_state_module
from celery_lease.app_state import AppState, app_state
from celery_lease.config import app_config


def test_each_app_has_one_state_made_on_first_use() -> None:
    first, second = Celery("state_one", set_as_current=False), Celery("state_two", set_as_current=False)
    state = app_state(first)
    assert isinstance(state, AppState) and app_state(first) is state
    assert app_state(second) is not state


def test_threads_making_a_new_apps_state_at_once_all_get_the_one_stored(monkeypatch) -> None:
    callers = 8
    app = Celery("state_race", set_as_current=False)
    made_together = threading.Barrier(callers, timeout=2)

    class Slow(AppState):
        """Every caller builds its state before any stores one: the race at its widest."""

        def __init__(self) -> None:
            super().__init__()
            with contextlib.suppress(threading.BrokenBarrierError):  # an implementation that builds once
                made_together.wait()

    monkeypatch.setattr(app_state_module, "AppState", Slow)
    seen: list[AppState] = []
    threads = [threading.Thread(target=lambda: seen.append(app_state(app))) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(seen) == callers and all(state is seen[0] for state in seen)


def test_the_settings_are_cached_in_the_state_and_read_again_once_it_forgets_them() -> None:
    app = Celery("state_config", set_as_current=False)
    cfg = app_config(app)
    assert app_state(app).config is cfg and app_config(app) is cfg
    app.conf.lease_duration = 77.0
    app_state(app).config = None
    assert app_config(app).policy().duration == 77.0


def test_take_clears_a_field_and_returns_what_it_held_once() -> None:
    state = app_state(Celery("state_take", set_as_current=False))
    state.store = store = object()
    assert state.take("store") is store
    assert state.store is None and state.take("store") is None
