"""The local deadline's arithmetic: the worker stops trusting a lease before the store lets it go."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_lease import deadline
from celery_lease.deadline import DRIFT, NOTICE, local_deadline, safety_margin, store_takeover_local_time

times = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)
durations = st.floats(min_value=0.5, max_value=86_400.0, allow_nan=False)
graces = st.floats(min_value=0.0, max_value=3600.0, allow_nan=False)
rates = st.floats(min_value=1.0 - DRIFT, max_value=1.0 + DRIFT, allow_nan=False)
delays = st.floats(min_value=0.0, max_value=600.0, allow_nan=False)


@given(sent=times, ran_after=delays, answered_after=delays, duration=durations, grace=graces, rate=rates)
def test_the_body_stops_trusting_its_lease_before_the_store_lets_another_owner_take_it(
        sent, ran_after, answered_after, duration, grace, rate):
    # Given a renewal sent at `sent`, run by the store `ran_after` store-seconds later and
    # confirmed whenever (the answer's delay plays no part), on a clock drifting within DRIFT
    lost_at = local_deadline(sent, duration)
    rounding = 1e-9 * (sent + duration + grace)  # float addition, not the argument
    # Then the body has noticed (timer late by NOTICE at most) before the reaper's first chance
    assert lost_at + NOTICE <= store_takeover_local_time(sent, ran_after, duration, grace, rate) + rounding
    # and no later than the store-side expiry itself (equal only at exactly 1% drift)
    assert lost_at + NOTICE <= store_takeover_local_time(sent, ran_after, duration, 0.0, rate) + rounding


@given(first=times, gap=delays, duration=durations)
def test_a_later_renewal_never_moves_the_deadline_back(first, gap, duration):
    assert local_deadline(first + gap, duration) >= local_deadline(first, duration)


def test_the_margin_for_the_default_lease():
    # lease_duration 30 s: 1% drift (0.3 s) and the timer's 0.1 s
    assert safety_margin(30.0) == pytest.approx(0.4)
    assert local_deadline(100.0, 30.0) == pytest.approx(129.6)


def test_the_clock_seam_is_monotonic_by_default():
    assert deadline.monotonic() <= deadline.monotonic()
