"""celery_lease.reaper.clock_guard: when a reaper run holds back, judged from what the store recorded."""

from __future__ import annotations

import time

import pytest

from celery_lease.reaper import clock_guard
from celery_lease.reaper.clock_guard import ClockGuard, Hold, host_clock

STALE = 10.0  # seconds of registry silence after which an owner looks gone
ELSEWHERE = "another-host/another-boot"  # a previous run whose monotonic clock is not ours


def previous_run(store, at: float, *, host: str = ELSEWHERE, interval: float | None = None,
                 mono: float | None = None, since: float | None = None) -> None:
    store.reaping.record_reaper_clock({"at": at, "mono": time.monotonic() if mono is None else mono,
                                       "host": host,
                                       "interval": interval, "calm_since": since})


class Hosts:
    """Reaper runs on several hosts, each with its own guard and monotonic clock, ``true`` seconds after
    ``start`` (the store's clock then); ``ahead``: how far the store's clock has since stepped or drifted."""

    def __init__(self, store, monkeypatch) -> None:
        self.store, self.monkeypatch, self.start = store, monkeypatch, store.now()
        self.guards: dict[str, ClockGuard] = {}
        self.boots: dict[str, float] = {}

    def mono(self, host: str, true: float) -> float:
        return self.boots.setdefault(host, 10_000.0 * (len(self.boots) + 1)) + true

    def run(self, host: str, true: float, ahead: float = 0.0) -> str | None:
        """Why this run held back, or None."""
        self.monkeypatch.setattr(clock_guard, "host_clock", lambda: host)
        guard = self.guards.setdefault(host, ClockGuard(1.0))
        return guard.judge(self.store, self.start + true + ahead, "r", STALE,
                           mono=(self.mono(host, true), 0.0)).reason


@pytest.fixture
def hosts(store, monkeypatch) -> Hosts:
    return Hosts(store, monkeypatch)


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


def test_a_step_is_held_back_by_a_host_that_ran_before_though_another_host_ran_last(store, hosts):
    # Runs 15 s apart on hosts A and B in turn, a beat dropped; then the store's clock steps +40 s. The gap
    # since B's run (55 s on the store's clock) passes the gap rule; A's own reading shows the step.
    previous_run(store, hosts.start - 15.0, interval=15.0)
    assert [hosts.run("A", 0.0), hosts.run("B", 15.0), hosts.run("B", 45.0)] == [None, None, None]
    reason = hosts.run("A", 60.0, ahead=40.0)
    assert reason is not None and "stepped +40.0s since this host's last reaper run" in reason


def test_two_hosts_taking_turns_for_hours_hold_nothing_back_though_their_clocks_drift_apart(store, hosts):
    # Runs half an hour apart, A and B in turn, the store's clock 500 ppm fast (within what NTP allows): each
    # host's own reading is an hour old, over which the clocks part by 1.8 s, more than the tolerance.
    previous_run(store, hosts.start - 1800.0, interval=1800.0)
    runs = [(("A", "B")[n % 2], n * 1800.0) for n in range(40)]
    assert [hosts.run(host, true, ahead=true * 0.0005) for host, true in runs] == [None] * 40


def test_the_reading_a_record_of_the_previous_version_holds_still_judges_its_hosts_next_run(store, hosts):
    # The previous version recorded only the last run's reading, at the top level (no "hosts").
    previous_run(store, hosts.start, host="A", mono=hosts.mono("A", 0.0), interval=15.0)
    assert "hosts" not in store.reaping.reaper_clock()
    assert hosts.run("B", 15.0) is None
    reason = hosts.run("A", 30.0, ahead=40.0)
    assert reason is not None and "stepped +40.0s" in reason


def test_a_dropped_beat_does_not_widen_the_gap_a_host_with_no_reading_lets_pass(store, hosts):
    # Runs 15 s apart on B, a beat dropped (30 s: calm); then the store's clock steps +40 s and A, which never
    # ran, runs 15 s later: 55 s on the store's clock is more than twice the usual 15 s.
    previous_run(store, hosts.start - 15.0, interval=15.0)
    assert [hosts.run("B", 0.0), hosts.run("B", 30.0)] == [None, None]
    reason = hosts.run("A", 45.0, ahead=40.0)
    assert reason is not None and "no reaper run for 55" in reason


def test_a_step_is_held_back_once_not_again_by_each_host_that_ran_before_it(store, hosts):
    # A +5 s step, within the gap rule: A's run sees it; B's reading, older than the step, must not again.
    previous_run(store, hosts.start - 10.0, interval=10.0)
    assert [hosts.run("A", 0.0), hosts.run("B", 10.0)] == [None, None]
    assert "stepped +5.0s" in hosts.run("A", 20.0, ahead=5.0)
    assert hosts.run("B", 30.0, ahead=5.0) is None


def test_the_record_keeps_the_readings_of_the_eight_most_recent_hosts(store, hosts):
    previous_run(store, hosts.start - 15.0, interval=15.0)
    names = [f"host-{n}" for n in range(10)]
    assert [hosts.run(host, n * 15.0) for n, host in enumerate(names)] == [None] * 10
    assert list(store.reaping.reaper_clock()["hosts"]) == names[2:]
