"""celery_lease.reaper.clock_guard: when a reaper run holds back, judged from what the store recorded."""

from __future__ import annotations

import time

import pytest

from celery_lease.reaper.clock_guard import ClockGuard, Hold, host_clock

STALE = 10.0  # seconds of registry silence after which an owner looks gone
ELSEWHERE = "another-host/another-boot"  # a previous run whose monotonic clock is not ours


def previous_run(store, at: float, *, host: str = ELSEWHERE, interval: float | None = None,
                 mono: float | None = None, since: float | None = None) -> None:
    store.reaping.record_reaper_clock({"at": at, "mono": time.monotonic() if mono is None else mono,
                                       "host": host,
                                       "interval": interval, "calm_since": since})


def test_a_first_run_with_no_history_holds_nothing_back(store):
    hold = ClockGuard(1.0).judge(store, store.now(), "r", STALE)
    assert hold == Hold()
    assert store.reaping.reaper_clock()["at"] is not None


def test_a_gap_shorter_than_the_registry_silence_holds_nothing_back(store):
    now = store.now()
    previous_run(store, now - STALE + 1)
    assert ClockGuard(1.0).judge(store, now, "r", STALE).reason is None


def test_a_gap_longer_than_the_registry_silence_holds_every_owner_a_lease_and_a_heartbeat(store):
    now = store.now()
    previous_run(store, now - STALE - 1)
    hold = ClockGuard(1.0).judge(store, now, "r", STALE)
    assert "no reaper run for" in hold.reason and hold.since == now
    assert hold.holds(now + 30.0 + 9.9, lease=30.0, heartbeat=10.0)
    assert not hold.holds(now + 30.0 + 10.0, lease=30.0, heartbeat=10.0)
    [event] = store.reports.events(None, "reaper_held_back")
    assert event["reason"] == hold.reason


def test_a_reaper_scheduled_less_often_than_the_registry_silence_holds_back_once_not_every_run(store):
    guard, now = ClockGuard(1.0), store.now()
    previous_run(store, now - 3 * STALE)
    reasons = []
    for n in range(4):  # runs 3 x STALE apart, each judged against the one before
        at = now + n * 3 * STALE
        reasons.append(guard.judge(store, at, "r", STALE).reason)
        recorded = store.reaping.reaper_clock()  # as another host would have recorded it (no monotonic)
        previous_run(store, at, interval=recorded["interval"], since=recorded["calm_since"])
    assert reasons[0] is not None and reasons[1:] == [None, None, None]


def test_a_second_outage_right_after_a_first_is_held_back_too(store):
    # Runs 5 s apart, then the store is away 10 minutes, back for one run, away again 15 minutes: the first
    # outage must not become the usual gap that lets the second pass.
    guard, now = ClockGuard(1.0), store.now()
    previous_run(store, now - 5.0, interval=5.0)
    reasons = []
    for at in (now, now + 600.0, now + 1500.0):
        reasons.append(guard.judge(store, at, "r", STALE).reason)
        recorded = store.reaping.reaper_clock()
        previous_run(store, at, interval=recorded["interval"], since=recorded["calm_since"])
    assert reasons[0] is None
    assert "no reaper run for 600" in reasons[1] and "no reaper run for 900" in reasons[2]


def test_a_failed_call_of_this_reaper_holds_its_next_run_back_however_short(store):
    guard = ClockGuard(1.0)
    guard.judge(store, store.now(), "r", STALE)
    guard.failed()
    assert "could not reach the store" in guard.judge(store, store.now(), "r", STALE).reason
    assert guard.judge(store, store.now(), "r", STALE).reason is None  # the next run is calm again


@pytest.mark.parametrize("step", [60.0, -60.0])
def test_a_store_clock_that_disagrees_with_this_hosts_monotonic_clock_is_a_step(store, step):
    now = store.now()
    # 5 s passed on this host since the previous run; the store's clock moved 5 s + step.
    previous_run(store, now - 5.0 - step, host=host_clock(), mono=time.monotonic() - 5.0)
    hold = ClockGuard(1.0).judge(store, now, "r", STALE)
    sign = "+" if step > 0 else "-"
    assert f"stepped {sign}" in hold.reason and hold.step_back == (step < 0)


def test_a_store_clock_behind_the_previous_run_of_another_host_stepped_back(store):
    now = store.now()
    previous_run(store, now + 30.0)
    hold = ClockGuard(1.0).judge(store, now, "r", STALE)
    assert "stepped back" in hold.reason and hold.step_back


def test_a_dry_run_judges_without_recording(store):
    now = store.now()
    previous_run(store, now - STALE - 1)
    before = store.reaping.reaper_clock()
    assert ClockGuard(1.0).judge(store, now, "r", STALE, record=False).reason is not None
    assert store.reaping.reaper_clock() == before and store.reports.events(None, "reaper_held_back") == []
