"""LeaseTask's consumer strategy (celery_lease/strategy.py) and its one read (store/glance.py).

The decision table is pure: which rows make a delivery a sure duplicate, acknowledged before
Celery's task-received. The read runs on SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import secrets

import pytest

from celery_lease.integration.strategy import _result_held, sure_duplicate
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


def test_a_completed_jobs_result_is_held_once_stored_but_not_while_celery_holds_a_failure_of_its_post_run():
    from celery import Celery
    from kombu.exceptions import OperationalError

    app = Celery("held", broker="memory://", backend="cache+memory://", set_as_current=False)

    @app.task(name="held.t", shared=False)
    def task() -> None:
        return None

    try:
        assert not _result_held(task, "j-missing")
        # After the body returned, the next step's publish failed: FAILURE, the copy resumes the post-run work
        task.backend.mark_as_failure("j-failed", OperationalError("[Errno 111] Connection refused"))
        assert not _result_held(task, "j-failed")
        task.backend.mark_as_done("j-done", 3)
        assert _result_held(task, "j-done")
    finally:
        app.close()


def test_glance_reads_status_owner_live_lease_and_kept_result(store):
    assert store.deliveries.glance("nope") is None
    store.publishes.record("j1", "t.work", "celery", None, 3)
    assert store.deliveries.glance("j1") == Glance(Status.PENDING, None, False, False)
    token = secrets.token_hex(16)
    assert store.jobs.claim("j1", "w2@host:41", token, TERMS, "t.work", "celery", lambda: None).claimed
    assert store.deliveries.glance("j1") == Glance(Status.RUNNING, "w2@host:41", True, False)
    assert store.jobs.complete("j1", token, "w2@host:41", result='{"v": 1}')
    assert store.deliveries.glance("j1") == Glance(Status.COMPLETED, "w2@host:41", False, True)


class _Message:
    def __init__(self, job_id: str) -> None:
        self.headers, self.delivery_info = {"id": job_id}, {}


def test_after_the_store_did_not_answer_the_strategy_passes_deliveries_on_unread(monkeypatch):
    # The read runs in the consumer's event loop: in an outage it would hold every delivery for the
    # store's call bound. After one unanswered read the next deliveries go straight to Celery's path.
    from celery import Celery

    import celery_lease.integration.strategy as strategy
    from celery_lease import LeaseTask

    app = Celery("strategy_quiet", broker="memory://", set_as_current=False)
    app.conf.lease_store_url = "postgresql+psycopg://postgres@127.0.0.1:1/test"  # nothing listens there

    @app.task(base=LeaseTask, shared=False, name="quiet.work")
    def quiet_work():
        return None

    app.finalize()
    work = app.tasks["quiet.work"]  # the task itself: the decorator's proxy is not a LeaseTask instance
    passed_on: list[str] = []
    reads: list[str] = []
    real_for_app = strategy.for_app

    def counted_for_app(app_):
        reads.append("read")
        return real_for_app(app_)

    class Consumer:
        hostname, connection_errors = NODE, ()
        event_dispatcher = type("Events", (), {"enabled": True})()

    monkeypatch.setattr(strategy, "for_app", counted_for_app)
    monkeypatch.setattr(strategy, "default", lambda *a, **kw: lambda message, *rest, **more: passed_on.append(
        message.headers["id"]))
    handler = strategy.lease_strategy(work, app, Consumer())
    for job_id in ("a", "b", "c"):
        handler(_Message(job_id), None, None, None, None)
    assert passed_on == ["a", "b", "c"] and len(reads) == 1

    monkeypatch.setattr(strategy, "QUIET", 0.0)  # no quiet spell: each delivery reads (and fails) again
    handler = strategy.lease_strategy(work, app, Consumer())
    for job_id in ("d", "e"):
        handler(_Message(job_id), None, None, None, None)
    assert passed_on[-2:] == ["d", "e"] and len(reads) == 3


def test_a_sure_duplicate_is_acknowledged_through_the_ack_celery_hands_the_strategy(store, monkeypatch):
    # Celery 5.7's ack promise also restores the prefetch count a reconnect reduced: a skip that acked the
    # message itself would leave a worker fed only duplicates at the reduced count.
    from celery import Celery

    import celery_lease.integration.strategy as strategy
    from celery_lease import LeaseTask

    app = Celery("strategy_ack", broker="memory://", set_as_current=False)
    app.conf.update(lease_store_url=store.url, lease_table_prefix=store.prefix)

    @app.task(base=LeaseTask, shared=False, name="ack.work")
    def ack_work():
        return None

    app.finalize()
    store.publishes.record("done-1", "ack.work", "celery", None, 3)
    token = secrets.token_hex(16)
    assert store.jobs.claim("done-1", "w2@host:41", token, TERMS, "ack.work", "celery", lambda: None).claimed
    assert store.jobs.complete("done-1", token, "w2@host:41")

    class Consumer:
        hostname, connection_errors = NODE, (ConnectionError,)
        event_dispatcher = type("Events", (), {"enabled": True})()

    class Message(_Message):
        def ack_log_error(self, *args):
            raise AssertionError("acknowledged behind Celery's ack promise")

    passed_on: list[str] = []
    acks: list[tuple] = []
    monkeypatch.setattr(strategy, "default", lambda *a, **kw: lambda message, *rest, **more: passed_on.append(
        message.headers["id"]))
    handler = strategy.lease_strategy(app.tasks["ack.work"], app, Consumer())
    try:
        handler(Message("done-1"), None, lambda *args: acks.append(args), None, None)
        handler(Message("never-recorded"), None, lambda *args: acks.append(args), None, None)
    finally:
        app.close()
    assert passed_on == ["never-recorded"]
    assert acks == [(strategy.log, (ConnectionError,))]
