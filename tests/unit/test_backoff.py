"""backoff.py: the delays that double and stop at a cap (the reaper's requeue backoff is tested
with the reaper, in test_reaper.py)."""

from __future__ import annotations

import random

from celery_lease.backoff import dispatch_wait, store_retry_delay


def test_the_store_retry_delay_doubles_per_re_send_between_half_and_all_of_its_step_up_to_the_cap():
    rng = random.Random(11)
    for retries, step in [(0, 5.0), (1, 10.0), (2, 20.0), (5, 160.0), (6, 300.0), (40, 300.0)]:
        delays = [store_retry_delay(retries, 5.0, 300.0, rng) for _ in range(500)]
        assert all(step / 2 <= d <= step for d in delays), (retries, min(delays), max(delays))
        assert max(delays) - min(delays) > step / 4  # jittered, not a fixed value
    assert store_retry_delay(10_000, 5.0, 300.0, rng) <= 300.0  # no overflow


def test_a_store_retry_cap_below_the_base_never_shortens_the_first_delay():
    assert 2.5 <= store_retry_delay(3, 5.0, 1.0, random.Random(1)) <= 5.0


def test_the_dispatch_wait_doubles_per_re_send_and_stops_at_the_cap():
    assert [dispatch_wait(600.0, n, 10800.0) for n in range(7)] == [
        600.0, 1200.0, 2400.0, 4800.0, 9600.0, 10800.0, 10800.0]
    assert dispatch_wait(600.0, 10_000, 10800.0) == 10800.0  # no overflow
    assert dispatch_wait(600.0, 3, 300.0) == 600.0  # a cap below the timeout never shortens it
