"""LeaseTask's consumer strategy (celery_lease/strategy.py) and its one read (store/glance.py).

The decision table is pure: which rows make a delivery a sure duplicate, acknowledged before
Celery's task-received. The read runs on SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import secrets

import pytest

from celery_lease.integration.strategy import sure_duplicate
from celery_lease.store import ClaimTerms, Glance
from celery_lease.vocabulary import Status

NODE = "w1@host"
TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=3, max_expirations=3, takeover=True)


def held() -> bool:
    return True


def missing() -> bool:
    return False


def not_asked() -> bool:
    raise AssertionError("the result backend is asked only of a completed job that kept its result")


@pytest.mark.parametrize(("glance", "backend", "sure"), [
    (None, not_asked, False),  # unknown: its claim records it
    (Glance(Status.PENDING, None, False, False), not_asked, False),
    (Glance(Status.FAILED, None, False, False), not_asked, True),
    (Glance(Status.RUNNING, "w2@host:41", True, False), not_asked, True),
    (Glance(Status.RUNNING, "w2@host:41", False, False), not_asked, False),  # expired: may be taken over
    (Glance(Status.RUNNING, f"{NODE}:42", True, False), not_asked, False),  # ours: a lost claim answer
    (Glance(Status.RUNNING, None, True, False), not_asked, False),
    (Glance(Status.COMPLETED, None, False, False), not_asked, True),  # no result kept
    (Glance(Status.COMPLETED, None, False, True), held, True),
    (Glance(Status.COMPLETED, None, False, True), missing, False),  # a crash's post-run work resumes
], ids=["unknown", "pending", "failed", "leased-elsewhere", "expired-elsewhere", "leased-here", "no-owner",
        "completed-unkept", "completed-held", "completed-unstored"])
def test_only_a_finished_job_or_a_live_lease_of_another_node_is_a_sure_duplicate(glance, backend, sure):
    assert sure_duplicate(glance, NODE, backend) is sure


def test_glance_reads_status_owner_live_lease_and_kept_result(store):
    assert store.deliveries.glance("nope") is None
    store.publishes.record("j1", "t.work", "celery", None, 3)
    assert store.deliveries.glance("j1") == Glance(Status.PENDING, None, False, False)
    token = secrets.token_hex(16)
    assert store.jobs.claim("j1", "w2@host:41", token, TERMS, "t.work", "celery", lambda: None).claimed
    assert store.deliveries.glance("j1") == Glance(Status.RUNNING, "w2@host:41", True, False)
    assert store.jobs.complete("j1", token, "w2@host:41", result='{"v": 1}')
    assert store.deliveries.glance("j1") == Glance(Status.COMPLETED, "w2@host:41", False, True)
