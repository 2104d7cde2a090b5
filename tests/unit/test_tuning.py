"""celery_lease.ops.tuning: percentiles and the lease settings they call for (pure functions)."""

from __future__ import annotations

import pytest

from celery_lease.config import load
from celery_lease.ops.tuning import LONG_JOB, percentile, recommend, tune_task


def policy(**options):
    return load({}).policy(options)


def test_percentile_interpolates_between_closest_ranks():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 99) is None


def test_short_job_gets_a_lease_of_twice_its_p99():
    rec = recommend(p99=20.0, gap_p99=1.0, policy=policy(lease_duration=10.0, lease_heartbeat_interval=3.0))
    assert rec["lease_duration"] == 40
    assert rec["lease_heartbeat_interval"] <= rec["lease_duration"] / 3
    assert rec["lease_max_runtime"] == 60


def test_long_job_keeps_a_short_heartbeat_renewed_lease():
    long_job = policy(lease_duration=30.0, lease_heartbeat_interval=10.0)
    rec = recommend(p99=3600.0, gap_p99=2.0, policy=long_job)
    assert rec["lease_duration"] == 60  # not two hours: a crash is recovered within a minute
    assert rec["lease_max_runtime"] == 3 * 3600


def test_a_setting_that_already_fits_is_kept():
    rec = recommend(p99=20.0, gap_p99=1.0, policy=policy(lease_duration=50.0, lease_heartbeat_interval=5.0,
                                                         lease_grace_period=10.0))
    assert rec["lease_duration"] == 50.0  # 40 recommended, 50 is within range
    assert rec["lease_heartbeat_interval"] == 5.0
    assert rec["lease_grace_period"] == 10.0


def test_slow_heartbeats_raise_the_lease_and_the_grace():
    rec = recommend(p99=1.0, gap_p99=12.0, policy=policy(lease_duration=30.0, lease_heartbeat_interval=10.0))
    assert rec["lease_duration"] >= 36  # three observed gaps
    assert rec["lease_grace_period"] >= 2  # the gap's lateness past one interval


def test_tune_warns_when_p99_nears_the_lease_without_heartbeat_headroom():
    runtimes = [9.0] * 100
    starved = tune_task("t", policy(lease_duration=10.0, lease_heartbeat_interval=2.0), runtimes, [9.5] * 100)
    assert any("nears the lease" in w for w in starved.warnings)
    assert any("heartbeat gap p99" in w for w in starved.warnings)
    healthy = tune_task("t", policy(lease_duration=10.0, lease_heartbeat_interval=2.0), runtimes, [2.1] * 100)
    assert not any("nears the lease" in w for w in healthy.warnings)


def test_tune_warns_about_few_samples_and_long_jobs_without_a_max_runtime():
    result = tune_task("t", policy(), [LONG_JOB * 2] * 5, [1.0] * 5)
    assert any("only 5 completed jobs" in w for w in result.warnings)
    assert any("without lease_max_runtime" in w for w in result.warnings)
    assert not tune_task("t", policy(lease_max_runtime=7200.0), [LONG_JOB * 2] * 50, [1.0] * 50).warnings


def test_tune_recommends_no_max_runtime_from_a_few_runs():
    # One 11 ms run would have capped the task at its 30 s lease.
    few = tune_task("t", policy(), [0.011], [1.0])
    assert "lease_max_runtime" not in few.recommended and "lease_duration" in few.recommended
    enough = tune_task("t", policy(), [0.011] * 50, [1.0] * 50)
    assert enough.recommended["lease_max_runtime"] == 30


def test_tune_without_samples_recommends_nothing():
    result = tune_task("t", policy(), [], [])
    assert result.recommended == {} and result.runtime_p99 is None
    assert "no completed jobs" in result.warnings[0]
