"""Job transitions in store/jobs.py on SQLite, PostgreSQL and MariaDB, winning and losing sides."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time

import pytest
import sqlalchemy as sa

from celery_lease.config import RECOVERY
from celery_lease.errors import LeaseConfigError, StoreConflict, StoreRejected, StoreUnavailable
from celery_lease.store import (
    COMPLETED,
    FAILED,
    PENDING,
    RUNNING,
    ClaimTerms,
    Store,
    StoreEngine,
)
from tests.helpers import transaction_held, wait_for


def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture
def store(store):
    """The shared store with this module's app-wide settings: a 60 s hard grace, workers stale
    after 10 s, no clock tolerance, claims committed synchronously."""
    store.hard_grace, store.stale_after = 60.0, 10.0
    store.clock_tolerance, store.claim_async_commit = 0.0, False
    return store


TERMS = {"duration": 30.0, "grace": 1.0, "max_attempts": 3, "max_expirations": 3, "takeover": True,
         "nesting": 0, "heartbeat": 0.0, "carried": None}


def claim(store: Store, job_id: str, worker: str = "w1", tok: str | None = None, **overrides):
    """Claim with a test task's terms; ``overrides`` name terms or the claim's other arguments."""
    terms = ClaimTerms(**{name: overrides.pop(name, default) for name, default in TERMS.items()})
    options = dict(task_name="t.task", queue="q", payload=lambda: '{"v": 1}')
    options.update(overrides)
    return store.jobs.claim(job_id, worker, tok or token(), terms, **options)


def age_lease(store: Store, job_id: str, seconds: float) -> None:
    """Move a lease's expiry into the past on the store's clock (test-only SQL)."""
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lease_expires_at=store.now_sql - seconds))


def events(store: Store, job_id: str) -> list[str]:
    return [e["event"] for e in store.reports.events(job_id)]


def test_record_inserts_a_pending_job_once(store):
    assert store.publishes.record("j1", "t.task", "q", "{}", 3) == (True, "j1")
    assert store.publishes.record("j1", "t.task", "q", "{}", 3) == (False, "j1")
    job = store.get("j1")
    assert job.status == PENDING and job.attempt_count == 0 and job.queue_name == "q"
    assert events(store, "j1") == ["published"]


def test_record_with_a_taken_idempotency_key_returns_the_holder(store):
    store.publishes.record("first", "t.task", "q", "{}", 3, idempotency_key="order-1")
    created, holder = store.publishes.record("second", "t.task", "q", "{}", 3, idempotency_key="order-1")
    assert (created, holder) == (False, "first")
    assert store.get("second") is None


def test_a_keyed_job_another_publish_was_answered_with_is_kept_when_its_own_send_fails(store):
    # A's message never went out, but B was told the key's job exists: forgetting it would leave B with a
    # job id nothing holds. It stays pending, for the dispatch scan, and keeps its key.
    def record(job_id: str) -> tuple[bool, str]:
        return store.publishes.record(job_id, "t.task", "q", "{}", 3, idempotency_key="order-K")

    assert record("first") == (True, "first")
    assert record("second") == (False, "first")
    assert store.publishes.forget_unpublished("first") is False
    assert store.get("first").status == PENDING
    assert record("third") == (False, "first")
    assert events(store, "first") == ["published", "keyed_publish_answered", "keyed_publish_answered"]
    # Claimed since, nothing can take the job back: an answer is no longer audited (nor the row held for it).
    with store.begin() as c:
        c.execute(sa.update(store.t.jobs).where(store.t.jobs.c.id == "first").values(attempt_count=1))
    assert record("fourth") == (False, "first")
    assert events(store, "first").count("keyed_publish_answered") == 2
    # Nobody answered with it: forgotten with its key, as before.
    store.publishes.record("alone", "t.task", "q", "{}", 3, idempotency_key="order-L")
    assert store.publishes.forget_unpublished("alone") is True and store.get("alone") is None


def test_a_keyed_record_whose_holder_is_forgotten_and_replaced_meanwhile_is_answered_with_the_new_holder(
        store, monkeypatch):
    # B reads A as the key's holder; A's send fails and A is forgotten; C records under the key. B must be
    # answered with C (or record itself), never with A, which no row holds any more.
    def record(job_id: str) -> tuple[bool, str]:
        return store.publishes.record(job_id, "t.task", "q", "{}", 3, idempotency_key="order-C")

    assert record("A") == (True, "A")
    real, calls = store.publishes._holder, []

    def holder(c, key, hold=False):
        found = real(c, key, hold)
        if not calls:
            calls.append(found)
            assert store.publishes.forget_unpublished("A") is True
            assert record("C") == (True, "C")
        return found

    monkeypatch.setattr(store.publishes, "_holder", holder)
    assert record("B") == (False, "C")
    assert store.get("A") is None and store.get("B") is None and store.get("C") is not None


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
def test_a_failed_sends_forget_waits_for_an_answer_in_flight_and_then_keeps_the_job(store):
    # B's answer holds the job's row while it writes its event; A's forget that meets it waits, then sees
    # the answer and keeps the job. Read before waiting, the forget would delete a job B was told exists.
    store.publishes.record("first", "t.task", "q", None, 3, idempotency_key="order-W")
    j, e = store.t.jobs, store.t.events
    answering = store.engine.connect()
    answering.execute(sa.select(j.c.id).where(j.c.id == "first").with_for_update())
    forgot: list[bool] = []
    forget = threading.Thread(target=lambda: forgot.append(store.publishes.forget_unpublished("first")),
                              daemon=True)
    forget.start()

    def waiting() -> int:
        with store.engine.connect() as c:
            return c.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                     "AND query LIKE :q"), {"q": f"%{store.prefix}jobs%"}).scalar_one()

    wait_for(lambda: waiting() == 1, timeout=10, message="the forget never waited for the answer's lock")
    answering.execute(sa.insert(e).values(job_id="first", event="keyed_publish_answered", at=store.now()))
    answering.commit()
    answering.close()
    forget.join(30)
    assert forgot == [False]
    assert store.get("first") is not None


def test_a_keyed_record_whose_holder_vanishes_after_the_conflict_takes_the_freed_key(store, monkeypatch):
    # The key's holder is forgotten (its message never went out) between this record's conflict and its
    # look-up of the holder: the key is free, so this job is recorded under it, not answered with its own
    # unrecorded id (which the caller would take for a job already sent).
    store.publishes.record("first", "t.task", "q", "{}", 3, idempotency_key="order-R")
    forgotten: list[bool] = []

    def on_conflict() -> None:
        if not forgotten:
            forgotten.append(store.publishes.forget_unpublished("first"))

    def conflicting(real):
        def conflicted(*args, **kwargs):
            try:
                return real(*args, **kwargs)
            except StoreConflict:
                on_conflict()
                raise
        return conflicted

    audited = store.publishes.audited
    for name in ("_execute_compiled", "_execute_positional"):
        monkeypatch.setattr(audited, name, conflicting(getattr(audited, name)))
    real_begin = store.publishes.db.begin

    @contextlib.contextmanager
    def begin(*args, **kwargs):
        try:
            with real_begin(*args, **kwargs) as c:
                yield c
        except StoreConflict:
            on_conflict()
            raise
    monkeypatch.setattr(store.publishes.db, "begin", begin)

    record = store.publishes.record
    assert record("second", "t.task", "q", "{}", 3, idempotency_key="order-R") == (True, "second")
    assert forgotten == [True]
    assert store.get("first") is None
    assert store.get("second").idempotency_key == "order-R"
    assert record("third", "t.task", "q", "{}", 3, idempotency_key="order-R") == (False, "second")


def test_an_error_text_holding_a_nul_is_stored_and_the_write_it_belongs_to_lands(store):
    # PostgreSQL's text refuses NUL: the failure, the retry and the effect's release would each be refused,
    # leaving the job running or the effect's key held for an effect that never happened.
    store.publishes.record("nul", "t.task", "q", "{}", 3)
    tok = token()
    assert claim(store, "nul", tok=tok).claimed
    assert store.effects.record_effect("mail:1", "nul", tok).value == "first"
    assert store.effects.release_effect("mail:1", "nul", tok, reason="ValueError: bad\x00byte")
    assert store.effects.record_effect("mail:1", "nul", tok).value == "first"
    assert store.jobs.retry_later("nul", tok, 0.0, None, "ValueError: bad\x00byte", "w1")
    tok = token()
    assert claim(store, "nul", tok=tok).claimed
    assert store.jobs.fail("nul", tok, "ValueError: bad\x00byte", "w1")
    job = store.get("nul")
    assert (job.status, job.last_error) == (FAILED, "ValueError: bad\\x00byte")
    assert [e["reason"] for e in store.reports.events("nul") if e["event"] == "failed"] == [job.last_error]


def test_an_error_text_holding_a_lone_surrogate_is_stored_and_the_failure_lands(store):
    # A file name decoded with os.fsdecode keeps an undecodable byte as a lone surrogate, which no driver
    # encodes: the failure would be refused and the job left running.
    error = "ValueError: cannot parse /data/" + os.fsdecode(b"report-\xff.csv")
    store.publishes.record("surrogate", "t.task", "q", "{}", 3)
    tok = token()
    assert claim(store, "surrogate", tok=tok).claimed
    assert store.jobs.fail("surrogate", tok, error, "w1")
    job = store.get("surrogate")
    assert (job.status, job.last_error) == (FAILED, "ValueError: cannot parse /data/report-\\udcff.csv")
    failed = [e["reason"] for e in store.reports.events("surrogate") if e["event"] == "failed"]
    assert failed == [job.last_error]


def test_an_id_or_key_no_database_can_store_is_refused_as_a_lease_error(store):
    bad = "job-" + os.fsdecode(b"\xff")
    with pytest.raises(StoreRejected, match="not valid Unicode"):
        store.publishes.record(bad, "t.task", "q", "{}", 3)
    with pytest.raises(StoreRejected, match="not valid Unicode"):
        store.get(bad)
    assert store.publishes.record("fine", "t.task", "q", "{}", 3) == (True, "fine")


def test_a_finished_job_published_again_with_reopen_runs_again(store):
    store.publishes.record("done", "t.task", "q", '{"v": 1}', 3)
    tok = token()
    assert claim(store, "done", tok=tok).claimed
    assert store.jobs.complete("done", tok, "w1")
    assert store.publishes.record("done", "t.task", "q", '{"v": 2}', 3) == (False, "done")
    assert store.get("done").status == COMPLETED  # without reopen: a duplicate, left alone
    assert store.publishes.record("done", "t.task", "q", '{"v": 2}', 3, reopen=True) == (False, "done")
    job = store.get("done")
    assert (job.status, job.attempt_count, job.lock_token, job.payload) == (PENDING, 0, None, '{"v": 2}')
    assert job.completed_at is None
    assert events(store, "done")[-1] == "republished"
    assert claim(store, "done").claimed


def test_reopen_leaves_unfinished_and_keyed_jobs_alone(store):
    store.publishes.record("waiting", "t.task", "q", "{}", 3)
    store.publishes.record("busy", "t.task", "q", "{}", 3)
    assert claim(store, "busy").claimed
    store.publishes.record("keyed", "t.task", "q", "{}", 3, idempotency_key="order-9")
    tok = token()
    assert claim(store, "keyed", tok=tok).claimed and store.jobs.complete("keyed", tok, "w1")
    for job_id in ("waiting", "busy", "keyed"):
        assert store.publishes.record(job_id, "t.task", "q", "{}", 3, reopen=True) == (False, job_id)
    assert [store.get(j).status for j in ("waiting", "busy", "keyed")] == [PENDING, RUNNING, COMPLETED]
    assert "republished" not in events(store, "waiting") + events(store, "busy") + events(store, "keyed")


def test_record_delay_sets_available_at_in_the_future(store):
    before = store.now()
    store.publishes.record("later", "t.task", "q", "{}", 3, delay=120.0)
    assert store.get("later").available_at >= before + 119.0


def test_claim_takes_a_pending_job_and_counts_the_attempt(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    tok = token()
    got = claim(store, "j1", tok=tok, duration=5.0)
    assert got.claimed
    job = got.job
    assert job.status == RUNNING and job.lock_token == tok and job.locked_by == "w1"
    assert job.attempt_count == 1
    assert job.lease_expires_at == pytest.approx(job.started_at + 5.0, abs=0.05)
    # A first claim: the row records it (owner, start, attempt), no event row.
    assert events(store, "j1") == ["published"]
    assert store.get("j1").started_at == job.started_at


def test_claim_of_a_leased_job_is_busy_and_changes_nothing(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    first = claim(store, "j1", "w1")
    second = claim(store, "j1", "w2")
    assert second.outcome == "busy"
    assert store.get("j1").lock_token == first.job.lock_token


def test_claim_of_a_finished_job_is_done(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    got = claim(store, "j1")
    assert store.jobs.complete("j1", got.job.lock_token)
    assert claim(store, "j1", "w2").outcome == "done"


def test_claim_before_the_job_is_available_is_early_and_changes_nothing(store):
    store.publishes.record("later", "t.task", "q", "{}", 3, delay=120.0)
    store.clock_tolerance = 1.0
    got = claim(store, "later")
    assert got.outcome == "early" and not got.claimed
    assert got.wait == pytest.approx(120.0, abs=5.0)
    job = store.get("later")
    assert (job.status, job.attempt_count, job.lock_token) == (PENDING, 0, None)
    assert events(store, "later") == ["published"]


def test_claim_within_the_clock_tolerance_takes_the_job(store):
    store.publishes.record("soon", "t.task", "q", "{}", 3, delay=5.0)
    store.clock_tolerance = 1.0
    assert claim(store, "soon").outcome == "early"
    store.clock_tolerance = 10.0
    assert claim(store, "soon").claimed


def test_claim_creates_the_row_of_a_job_published_without_celery_lease(store):
    got = claim(store, "stranger", payload=lambda: "PAYLOAD")
    assert got.claimed
    job = store.get("stranger")
    assert job.status == RUNNING and job.attempt_count == 1 and job.payload == "PAYLOAD"


def test_racing_claims_have_exactly_one_winner(store):
    store.publishes.record("race", "t.task", "q", "{}", 3)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def contender(n: int) -> None:
        barrier.wait()
        outcomes.append(claim(store, "race", f"w{n}").outcome)

    threads = [threading.Thread(target=contender, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["busy"] * 7 + ["claimed"]
    assert store.get("race").attempt_count == 1


def test_claim_takes_over_an_abandoned_lease_past_grace(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    old = claim(store, "j1", "dead-worker").job.lock_token
    age_lease(store, "j1", 5.0)
    got = claim(store, "j1", "w2", grace=1.0)
    assert got.claimed
    assert got.job.expired_count == 1 and got.job.attempt_count == 2 and got.job.lock_token != old
    assert "lease_taken_over" in events(store, "j1")


def test_claim_does_not_take_over_inside_the_grace_period(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    claim(store, "j1", "dead-worker", grace=30.0)
    age_lease(store, "j1", 5.0)
    assert claim(store, "j1", "w2").outcome == "busy"


def test_claim_leaves_a_live_owner_alone_until_the_hard_grace(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    claim(store, "j1", "live-worker", grace=0.0)
    store.workers.touch_worker("live-worker", "host", 1)
    age_lease(store, "j1", 5.0)
    assert claim(store, "j1", "w2").outcome == "busy"  # within the 60 s hard grace
    store.hard_grace = 2.0
    assert claim(store, "j1", "w2").claimed


def test_claim_does_not_take_over_while_the_reapers_hold_covers_the_owner(store):
    # After the store was away or its clock stepped forward, every lease looks expired and every owner
    # gone; an owner still running has its lease and a heartbeat to renew before a copy of its message
    # may take the job over, as the reaper waits.
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    claim(store, "j1", "owner", grace=0.0, duration=3.0)
    age_lease(store, "j1", 5.0)
    now = store.now()
    store.reaping.record_reaper_clock({"at": now, "calm_since": now - 3.0}, held_back="the clock stepped")
    assert claim(store, "j1", "w2", heartbeat=2.0).outcome == "busy"  # 3 s ago < 3 s lease + 2 s heartbeat
    assert "lease_taken_over" not in events(store, "j1")
    store.reaping.record_reaper_clock({"at": now, "calm_since": now - 6.0})  # the hold is over
    assert claim(store, "j1", "w2", heartbeat=2.0).claimed


def test_claim_does_not_take_over_when_attempts_are_exhausted(store):
    store.publishes.record("j1", "t.task", "q", "{}", 1)
    claim(store, "j1", "dead-worker", grace=0.0, max_attempts=1)
    age_lease(store, "j1", 5.0)
    assert claim(store, "j1", "w2", max_attempts=1).outcome == "busy"


def test_complete_with_a_stale_token_changes_nothing_and_is_audited(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    tok = claim(store, "j1").job.lock_token
    assert store.jobs.complete("j1", "stale-token") is False
    assert store.get("j1").status == RUNNING
    assert "stale_completion_rejected" in events(store, "j1")
    assert store.jobs.complete("j1", tok) is True
    job = store.get("j1")
    assert job.status == COMPLETED and job.lock_token is None and job.completed_at is not None


def test_a_completion_keeps_its_result_in_the_same_write_and_only_when_given(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    store.publishes.record("j2", "t.task", "q", "{}", 3)
    tok1, tok2 = claim(store, "j1").job.lock_token, claim(store, "j2").job.lock_token
    assert store.jobs.kept_result("j1") is None  # running: nothing to finish
    assert store.jobs.complete("j1", "stale-token", result='"stale"') is False
    assert store.jobs.complete("j1", tok1, result='{"data": "42"}') is True
    assert store.jobs.complete("j2", tok2) is True
    assert (store.jobs.kept_result("j1"), store.jobs.kept_result("j2"), store.jobs.kept_result("nope")) == (
        '{"data": "42"}', None, None)
    # The row records the completion once (the stale write is the one event): no "completed" row.
    assert events(store, "j1") == ["published", "stale_completion_rejected"]
    assert store.get("j1").status == COMPLETED and store.get("j1").completed_at is not None


def test_a_claim_whose_answer_was_lost_is_taken_back_by_its_own_worker_only(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    lost = claim(store, "j1", worker="w1").job.lock_token  # committed; the worker never heard
    terms = ClaimTerms(**TERMS)
    assert store.jobs.reclaim("j1", lost, "w2", token(), terms) is None  # not w2's claim
    assert store.jobs.reclaim("j1", "other-token", "w1", token(), terms) is None
    fresh = token()
    job = store.jobs.reclaim("j1", lost, "w1", fresh, terms)
    assert (job.status, job.lock_token, job.locked_by, job.attempt_count) == (RUNNING, fresh, "w1", 1)
    assert store.jobs.reclaim("j1", lost, "w1", token(), terms) is None  # once
    assert events(store, "j1") == ["published", "claim_taken_back"]  # the same owner: no takeover
    taken_back = store.reports.list_events(job_id="j1", event="claim_taken_back")[0]
    assert json.loads(taken_back["detail"]) == {"previous_owner": "w1", "previous_token": lost[:8],
                                                "previous_started_at": pytest.approx(job.started_at, abs=60)}
    assert store.jobs.complete("j1", lost) is False and store.jobs.complete("j1", fresh) is True


def test_fail_is_fenced_and_records_the_error(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    tok = claim(store, "j1").job.lock_token
    assert store.jobs.fail("j1", "stale-token", "boom") is False
    assert "stale_failure_rejected" in events(store, "j1")
    assert store.jobs.fail("j1", tok, "ValueError: boom") is True
    job = store.get("j1")
    assert job.status == FAILED and job.last_error == "ValueError: boom"


def test_retry_later_reschedules_the_job_as_pending(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    tok = claim(store, "j1").job.lock_token
    assert store.jobs.retry_later("j1", "stale", 10.0, None, "x") is False
    now = store.now()
    assert store.jobs.retry_later("j1", tok, 10.0, "NEW", "IOError: flaky") is True
    job = store.get("j1")
    assert job.status == PENDING and job.lock_token is None and job.payload == "NEW"
    assert job.available_at == pytest.approx(now + 10.0, abs=1.0)


def test_release_gives_the_attempt_back(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    tok = claim(store, "j1").job.lock_token
    assert store.jobs.release("j1", tok, "w1") is True
    job = store.get("j1")
    assert job.status == PENDING and job.attempt_count == 0 and job.locked_by is None
    assert "released_on_shutdown" in events(store, "j1")
    assert store.jobs.release("j1", tok, "w1") is False


def test_renew_extends_only_leases_whose_token_still_matches(store):
    for job_id in ("a", "b", "c"):
        store.publishes.record(job_id, "t.task", "q", "{}", 3)
    toks = {claim(store, job_id, duration=5.0).job.lock_token: job_id for job_id in ("a", "b")}
    age_lease(store, "a", 1.0)
    renewed = store.jobs.renew({**toks, "stale-token": "c"}, "w1")
    assert renewed == {"a", "b"}
    job = store.get("a")
    assert job.lease_expires_at == pytest.approx(job.last_heartbeat_at + 5.0, abs=0.05)


def test_renew_with_extend_sets_a_longer_lease(store):
    store.publishes.record("a", "t.task", "q", "{}", 3)
    tok = claim(store, "a", duration=5.0).job.lock_token
    assert store.jobs.renew({tok: "a"}, "w1", {tok: 120.0}) == {"a"}
    job = store.get("a")
    assert job.lease_duration == 120.0
    assert job.lease_expires_at == pytest.approx(job.last_heartbeat_at + 120.0, abs=0.05)


def test_describe_loss_tells_a_vanished_lease_from_a_taken_one(store):
    store.publishes.record("gone", "t.task", "q", "{}", 3)
    store.publishes.record("taken", "t.task", "q", "{}", 3)
    claim(store, "taken", "dead")
    age_lease(store, "taken", 5.0)
    claim(store, "taken", "thief")
    assert store.jobs.describe_loss("gone-missing", "tok") == ("vanished", None)
    assert store.jobs.describe_loss("taken", "tok") == ("taken_over", "thief")


def test_cancel_fails_an_unfinished_job_once(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    assert store.jobs.cancel("j1", "revoked") is True
    assert store.get("j1").status == FAILED
    assert store.jobs.cancel("j1", "revoked") is False


def test_a_revoked_delivery_records_a_vanished_job_again_as_failed(store):
    assert store.jobs.cancel("gone", "revoked") is False  # no message named it: nothing to record
    assert store.get("gone") is None
    assert store.jobs.cancel("gone", "revoked", task_name="t.task", queue="q") is True
    job = store.get("gone")
    assert (job.status, job.task_name, job.queue_name, job.last_error) == (FAILED, "t.task", "q",
                                                                          "revoked (revoked)")
    assert [e["event"] for e in store.reports.events("gone")] == ["revoked"]
    store.publishes.record("done", "t.task", "q", "{}", 3)
    tok = claim(store, "done").job.lock_token
    assert store.jobs.complete("done", tok)
    assert store.jobs.cancel("done", "revoked", task_name="t.task", queue="q") is False  # finished: kept
    assert store.get("done").status == COMPLETED


def test_cancel_leaves_a_running_job_to_its_run_unless_its_owner_is_terminated(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    claim(store, "j1", "node@h:7")
    assert store.jobs.cancel("j1", "expired") is False
    assert store.jobs.cancel("j1", "terminated", owner="node@h:8") is False
    assert store.get("j1").status == RUNNING
    assert store.jobs.cancel("j1", "terminated", owner="node@h:7") is True
    job = store.get("j1")
    assert (job.status, job.last_error, job.lock_token) == (FAILED, "revoked (terminated)", None)


def test_a_hand_over_puts_the_job_back_to_pending_with_the_carriers_message(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    tok = claim(store, "j1").job.lock_token
    assert store.replacing.hand_over("j1", "stale", "w1", '{"v": 2}', "t.next") is False
    assert store.replacing.hand_over("j1", tok, "w1", '{"v": 2}', "t.next") is True
    job = store.get("j1")
    assert (job.status, job.payload, job.attempt_count, job.lock_token) == (PENDING, '{"v": 2}', 0, None)
    assert events(store, "j1")[-1] == "handed_over"


def test_a_hand_over_to_a_later_carrier_removes_the_row_and_replaced_completes_it(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    store.publishes.record("j2", "t.task", "q", "{}", 3)
    assert store.replacing.hand_over("j1", claim(store, "j1").job.lock_token, "w1", None, "t.last") is True
    assert store.get("j1") is None and events(store, "j1")[-1] == "handed_over"
    assert store.replacing.replaced("j2", claim(store, "j2").job.lock_token, "w1",
                                    "celery.accumulate") is True
    assert store.get("j2").status == COMPLETED and events(store, "j2")[-1] == "replaced"


def test_a_copy_of_a_replaced_runs_message_is_not_a_first_sighting_of_the_job(store):
    """Between a hand-over to a later carrier and the carrier's record no row exists: a copy of
    the replaced run's message (its nesting) is skipped, the carrier's (one deeper) runs."""
    from celery_lease.store import NewJob
    from celery_lease.vocabulary import ClaimOutcome, Event

    store.publishes.record("j1", "t.task", "q", "{}", 3)
    assert store.replacing.hand_over_to_step("j1", claim(store, "j1").job.lock_token, "w1", "t.last",
                                             NewJob("s1", "t.step", "q", "{}", 3), 0) is True
    copy = claim(store, "j1", nesting=0)
    assert (copy.outcome, copy.job) == (ClaimOutcome.REPLACED, None)
    assert copy.step is not None and (copy.step.id, copy.step.status) == ("s1", PENDING)  # it carries the job
    assert store.get("j1") is None
    store.event("j1", Event.DUPLICATE_DELIVERY_SKIPPED, "job replaced")  # what the skip audits
    assert claim(store, "j1", nesting=0).outcome == ClaimOutcome.REPLACED  # a second copy too
    carrier = claim(store, "j1", nesting=1)  # the carrier's message, its record lost: it runs
    assert carrier.claimed and store.get("j1").status == RUNNING


def test_a_copy_after_a_hand_over_to_an_unleased_first_step_runs_as_a_first_sighting(store):
    """No row carries such a job on (its first step is not leased): a copy of the replaced message
    may be its only way on (a hand-over whose answer was lost), so it is not skipped."""
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    assert store.replacing.hand_over("j1", claim(store, "j1").job.lock_token, "w1", None, "t.last", 0) is True
    copy = claim(store, "j1", nesting=0)
    assert copy.claimed and store.get("j1").status == RUNNING


def carried(payload: str | None) -> int | None:
    """The nesting a test's stored message names (the worker reads Celery's message: messages.nesting_of)."""
    return json.loads(payload).get("nesting", 0) if payload else None


def test_a_copy_of_a_replaced_runs_message_never_claims_the_row_its_carrier_was_recorded_on(store):
    """A copy of the replaced run's message (an outage's re-send, a give-back's) that arrives after the
    chain's last step recorded the job's row again must not claim that row: it would run the replaced body
    a second time and replace the job again. The carrier (one deeper) claims it; a copy skipped is told the
    row, so its message can be sent again. The same holds for a single replacement's pending row."""
    from celery_lease.store import NewJob
    from celery_lease.vocabulary import ClaimOutcome

    store.publishes.record("j1", "t.task", "q", '{"nesting": 0}', 3)
    assert store.replacing.hand_over_to_step("j1", claim(store, "j1").job.lock_token, "w1", "t.last",
                                             NewJob("s1", "t.step", "q", "{}", 3), 0) is True
    store.publishes.record("j1", "t.task", "q", '{"nesting": 1}', 3, reopen=True)  # the first step ran
    copy = claim(store, "j1", nesting=0, carried=carried)
    assert copy.outcome == ClaimOutcome.REPLACED and not copy.claimed
    assert (copy.step.id, copy.step.status, copy.step.payload) == ("j1", PENDING, '{"nesting": 1}')
    carrier = claim(store, "j1", nesting=1, carried=carried)
    assert carrier.claimed and store.get("j1").status == RUNNING
    age_lease(store, "j1", 3600)  # the carrier's lease abandoned: a copy does not take it over
    assert claim(store, "j1", nesting=0, carried=carried).outcome == ClaimOutcome.REPLACED
    assert store.get("j1").lock_token == carrier.job.lock_token

    store.publishes.record("j2", "t.task", "q", '{"nesting": 0}', 3)
    assert store.replacing.hand_over("j2", claim(store, "j2").job.lock_token, "w1", '{"nesting": 1}',
                                     "t.next", 0) is True
    assert claim(store, "j2", nesting=0, carried=carried).outcome == ClaimOutcome.REPLACED
    assert claim(store, "j2", nesting=1, carried=carried).claimed
    # The same id published again on purpose once it finished runs as any reopened job does.
    assert store.jobs.complete("j2", store.get("j2").lock_token, "w1")
    store.publishes.record("j2", "t.task", "q", '{"nesting": 0}', 3, reopen=True)
    assert claim(store, "j2", nesting=0, carried=carried).claimed


def test_a_replaced_jobs_row_that_holds_no_deeper_message_is_claimed_as_any_row(store):
    """Only a row holding the replacement's own (deeper) message refuses a delivery, so that message, sent
    again, is never refused: a job published anew under the id of one whose row went (its events stayed),
    and a replacement whose message carries no nesting (task_protocol 1, Celery before 5.3.5), are claimed."""
    store.publishes.record("j1", "t.task", "q", '{"nesting": 0}', 3)
    assert store.replacing.hand_over("j1", claim(store, "j1").job.lock_token, "w1", '{"nesting": 1}',
                                     "t.next", 0) is True
    with store.begin() as c:  # the row went (a discarded dead letter, a pruned job); its events stay
        c.execute(sa.delete(store.t.jobs).where(store.t.jobs.c.id == "j1"))
    store.publishes.record("j1", "t.task", "q", '{"nesting": 0}', 3)
    assert claim(store, "j1", nesting=0, carried=carried).claimed

    store.publishes.record("j2", "t.task", "q", '{"nesting": 0}', 3)
    assert store.replacing.hand_over("j2", claim(store, "j2").job.lock_token, "w1", "{}", "t.next", 0) is True
    assert claim(store, "j2", nesting=0, carried=carried).claimed  # the carrier, nesting 0 as its message


def test_a_hand_over_to_a_first_step_removes_the_row_and_records_the_step_in_one_write(store):
    from celery_lease.store import NewJob

    store.publishes.record("j1", "t.task", "q", "{}", 3)
    store.publishes.record("taken", "t.task", "q", "{}", 3)
    tok = claim(store, "j1").job.lock_token
    step = NewJob("s1", "t.step", "q", '{"v": 3}', 3)
    assert store.replacing.hand_over_to_step("j1", "stale", "w1", "t.last", step) is False
    assert store.get("j1").status == RUNNING and store.get("s1") is None
    # A step whose id is taken writes nothing: the replaced row stays.
    assert store.replacing.hand_over_to_step("j1", tok, "w1", "t.last", NewJob("taken", "t.step", "q", "{}",
                                                                               3)) is None
    assert store.get("j1").status == RUNNING
    assert store.replacing.hand_over_to_step("j1", tok, "w1", "t.last", step) is True
    assert store.get("j1") is None and events(store, "j1")[-1] == "handed_over"
    job = store.get("s1")
    assert (job.status, job.payload, job.task_name) == (PENDING, '{"v": 3}', "t.step")
    assert events(store, "s1") == ["published"]


def test_checkpoint_is_fenced_by_the_token(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    tok = claim(store, "j1").job.lock_token
    assert store.jobs.checkpoint("j1", "stale", {"step": 9}) is False
    assert store.jobs.checkpoint("j1", tok, {"step": 2}) is True
    assert store.get("j1").checkpoint_state() == {"step": 2}


def test_an_unreachable_store_raises_store_unavailable(tmp_path):
    store = Store("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.now()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        claim(store, "a")
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.jobs.complete("a", token())


def _backend_pid(store: Store) -> int:
    raw = store.engine.raw_connection()
    try:
        return raw.driver_connection.info.backend_pid
    finally:
        raw.close()


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
def test_a_dropped_postgres_connection_fails_one_claim_and_the_next_reconnects(store):
    for job_id in ("a", "b", "c"):
        store.publishes.record(job_id, "t.task", "q", None, 3)
    assert claim(store, "a").claimed  # the pool now holds one warm connection
    doomed = _backend_pid(store)
    admin = sa.create_engine(store.url)
    try:
        with admin.begin() as c:
            assert c.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": doomed}).scalar()
    finally:
        admin.dispose()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        claim(store, "b")
    # The broken connection was thrown away, not handed out again.
    assert claim(store, "b").claimed and claim(store, "c").claimed
    assert store.get("b").status == RUNNING and _backend_pid(store) != doomed


def test_claim_and_complete_on_an_unmigrated_store_say_to_migrate(store_factory):
    store = store_factory(migrate=False)
    with pytest.raises(StoreUnavailable, match="lease migrate"):
        claim(store, "a")
    with pytest.raises(StoreUnavailable, match="lease migrate"):
        store.jobs.complete("a", token())


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("async_commit", [True, False])
def test_an_async_claim_turns_off_synchronous_commit_for_its_own_transaction_only(store, async_commit):
    store.publishes.record("a", "t.task", "q", None, 3)
    store.publishes.record("b", "t.task", "q", None, 3)
    params = {"job_id": "a", "worker": "w1", "token": token(), "duration": 30.0, "grace": 1.0, "early": 0.0,
              **{f"r_{name}": None for name in RECOVERY}}
    with store.begin() as c:
        assert c.execute(store.jobs._claim_pending_statement(async_commit), params).rowcount == 1
        inside = c.execute(sa.text("SELECT current_setting('synchronous_commit')")).scalar()
        c.rollback()
    assert inside == ("off" if async_commit else "on")
    store.claim_async_commit = async_commit
    assert claim(store, "b").claimed
    raw = store.engine.raw_connection()  # the connection the claim ran on, back in the pool
    try:
        assert raw.driver_connection.execute("SHOW synchronous_commit").fetchone()[0] == "on"
    finally:
        raw.close()


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("opt_in", [False, True])
def test_a_claim_waits_for_its_wal_flush_unless_the_app_opts_in(store_url, store_factory, opt_in):
    """A claim a crash can undo lets a second delivery claim the job beside the first run: with
    the default settings a claim commits durably; only lease_claim_async_commit=True does not.
    A trigger (test-only SQL) reads synchronous_commit inside the claim's own transaction."""
    from celery_lease.config import load

    plain = store_factory(reuse=False)
    settings = {"lease_store_url": store_url, "lease_table_prefix": plain.prefix}
    if opt_in:
        settings["lease_claim_async_commit"] = True
    cfg = load(settings)
    assert cfg.claim_async_commit is opt_in
    probe, jobs = f"{plain.prefix}probe", plain.t.jobs.name
    with plain.begin() as c:
        c.execute(sa.text(f"CREATE TABLE {probe} (job_id text, setting text)"))
        c.execute(sa.text(
            f"CREATE FUNCTION {probe}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"INSERT INTO {probe} VALUES (NEW.id, current_setting('synchronous_commit')); "
            f"RETURN NEW; END $$"))
        c.execute(sa.text(f"CREATE TRIGGER {probe} BEFORE UPDATE ON {jobs} FOR EACH ROW "
                          f"EXECUTE FUNCTION {probe}()"))
    app_store = Store.from_config(cfg)
    try:
        app_store.publishes.record("a", "t.task", "q", None, 3)
        assert claim(app_store, "a").claimed
        with plain.begin() as c:
            seen = [tuple(r) for r in c.execute(sa.text(f"SELECT job_id, setting FROM {probe}"))]
            c.execute(sa.text(f"DROP TABLE {probe}"))
            c.execute(sa.text(f"DROP TRIGGER {probe} ON {jobs}"))
            c.execute(sa.text(f"DROP FUNCTION {probe}()"))
    finally:
        app_store.engine.dispose()
    assert seen == [("a", "off" if opt_in else "on")]


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
@pytest.mark.parametrize(("every_transition", "rows"), [(False, 2), (True, 4)])
def test_a_job_run_on_the_happy_path_writes_two_rows_on_postgres(store_url, store_factory, every_transition,
                                                                 rows):
    """The claim and the completion of a published job: the job row's two updates, and two event
    rows more only with lease_audit_every_transition. A trigger (test-only SQL) on every table of
    the store's prefix counts each row written, whatever path the statement took to the server."""
    from celery_lease.config import load

    plain = store_factory(reuse=False)
    cfg = load({"lease_store_url": store_url, "lease_table_prefix": plain.prefix,
                "lease_audit_every_transition": every_transition})
    assert cfg.audit_every_transition is every_transition
    probe = f"{plain.prefix}written"
    names = [t.name for t in plain.t.jobs.metadata.tables.values()]
    with plain.begin() as c:
        c.execute(sa.text(f"CREATE TABLE {probe} (tbl text, op text)"))
        c.execute(sa.text(
            f"CREATE FUNCTION {probe}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"INSERT INTO {probe} VALUES (TG_TABLE_NAME, TG_OP); RETURN NULL; END $$"))
        for name in names:
            c.execute(sa.text(f"CREATE TRIGGER {probe} AFTER INSERT OR UPDATE OR DELETE ON {name} "
                              f"FOR EACH ROW EXECUTE FUNCTION {probe}()"))
    app_store = Store.from_config(cfg)
    try:
        assert app_store.audit_every_transition is every_transition
        app_store.publishes.record("happy", "t.task", "q", None, 3)
        with plain.begin() as c:
            c.execute(sa.text(f"DELETE FROM {probe}"))  # the publish's record is not counted
        tok = token()
        assert claim(app_store, "happy", tok=tok).claimed
        assert app_store.jobs.complete("happy", tok, "w1", result='"done"')
        with plain.begin() as c:
            seen = sorted(tuple(r) for r in c.execute(sa.text(f"SELECT tbl, op FROM {probe}")))
            c.execute(sa.text(f"DROP FUNCTION {probe}() CASCADE"))
            c.execute(sa.text(f"DROP TABLE {probe}"))
    finally:
        app_store.engine.dispose()
    jobs, events = plain.t.jobs.name, plain.t.events.name
    assert seen == sorted([(jobs, "UPDATE")] * 2 + [(events, "INSERT")] * (rows - 2))
    assert len(seen) == rows
    job = plain.get("happy")
    assert (job.status, job.locked_by, job.attempt_count) == (COMPLETED, "w1", 1)


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("async_commit", [True, False])
def test_an_async_publish_record_turns_off_synchronous_commit_for_its_own_statement_only(store, async_commit):
    store.publish_async_commit = async_commit
    built = store.publishes._record_statements(keyed=True)
    assert built.compiled is not None
    sql, static = built.compiled
    params = {"p_job": "a", "p_task": "t.task", "p_queue": "q", "p_payload": None, "p_max_attempts": 3,
              "p_key": "k-a", "p_delay": 0.0, "p_detail": None, **{f"r_{name}": None for name in RECOVERY}}
    with store.begin() as c:
        assert c.exec_driver_sql(sql, {**static, **params}).scalar() == "a"
        inside = c.execute(sa.text("SELECT current_setting('synchronous_commit')")).scalar()
        c.rollback()
    assert inside == ("off" if async_commit else "on")
    # A real publish record: the job, its key and its event are written; the pooled connection
    # it ran on waits for the flush again afterwards.
    assert store.publishes.record("b", "t.task", "q", None, 3, idempotency_key="k-b") == (True, "b")
    assert store.publishes.record("c", "t.task", "q", None, 3, idempotency_key="k-b") == (False, "b")
    assert [e["event"] for e in store.reports.events("b")] == ["published", "keyed_publish_answered"]
    raw = store.engine.raw_connection()
    try:
        assert raw.driver_connection.execute("SHOW synchronous_commit").fetchone()[0] == "on"
    finally:
        raw.close()


def test_for_app_bounds_calls_by_the_shortest_lease_and_sizes_the_pool_by_concurrency(tmp_path):
    from celery import Celery

    from celery_lease import LeaseTask
    from celery_lease.store import for_app

    app = Celery("bounds", set_as_current=False)
    app.conf.update(lease_store_url=f"sqlite:///{tmp_path / 'lease.sqlite3'}", lease_duration=30.0,
                    lease_heartbeat_interval=1.0, lease_queue_policies={"fast": {"lease_duration": 12.0}},
                    worker_concurrency=4)

    @app.task(base=LeaseTask, lease_duration=6.0, shared=False)
    def quick():
        return None

    store = for_app(app, check=False)
    assert store.bounds.call == pytest.approx(2.0)  # a third of the 6 s lease
    assert store.pool_size == 6  # four tasks, the heartbeat and one spare


def test_store_engine_options_are_merged_last(tmp_path):
    from celery_lease.config import load

    cfg = load({"lease_store_url": f"sqlite:///{tmp_path / 'lease.sqlite3'}",
                "lease_store_engine_options": {"poolclass": sa.pool.NullPool}})
    store = Store.from_config(cfg, call_timeout=3.0)
    assert isinstance(store.engine.pool, sa.pool.NullPool)
    assert store.bounds.call == 3.0
    assert store.now() > 0


def test_an_engine_option_sqlalchemy_refuses_is_a_config_error_naming_the_setting(tmp_path):
    from celery_lease.config import load

    cfg = load({"lease_store_url": f"sqlite:///{tmp_path / 'lease.sqlite3'}",
                "lease_store_engine_options": {"bogus": 1}})
    with pytest.raises(LeaseConfigError) as info:
        Store.from_config(cfg).now()
    assert info.value.setting == "lease_store_engine_options" and "bogus" in str(info.value)


def test_the_store_takes_the_app_wide_lease_settings_from_the_config_and_defaults_from_config_py(tmp_path):
    from celery_lease.config import BY_NAME, load

    url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    cfg = load({"lease_store_url": url, "lease_reaper_hard_grace": 7.0, "lease_worker_stale_after": 3.0,
                "lease_clock_tolerance": 0.25, "lease_claim_async_commit": True,
                "lease_publish_async_commit": True})
    store = Store.from_config(cfg)
    assert (store.hard_grace, store.stale_after, store.clock_tolerance, store.claim_async_commit,
            store.publish_async_commit) == (7.0, 3.0, 0.25, True, True)
    plain = Store(url)
    defaults = ("lease_reaper_hard_grace", "lease_clock_tolerance", "lease_claim_async_commit",
                "lease_publish_async_commit")
    assert (plain.hard_grace, plain.clock_tolerance, plain.claim_async_commit,
            plain.publish_async_commit) == tuple(BY_NAME[name].default for name in defaults)
    # Unset, the worker staleness is derived from the lease settings: lease + grace - a heartbeat.
    assert plain.stale_after == 30.0
    quick = load({"lease_store_url": url, "lease_duration": 6.0, "lease_heartbeat_interval": 1.0,
                  "lease_grace_period": 1.0})
    assert Store.from_config(quick).stale_after == 6.0


def _calls(cls: type) -> set[str]:
    """The public calls of a class (a property is no call)."""
    return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))}


def test_each_statement_group_of_a_store_is_built_on_that_store(sqlite_url):
    store = Store(sqlite_url, "roles_")
    groups = {name: group for name, group in vars(store).items() if hasattr(group, "db")}
    assert set(groups) == {"audited", "publishes", "jobs", "replacing", "workers", "effects", "deliveries",
                           "reaping", "runs", "recovery", "reports"}
    assert all(group.db is store for group in groups.values())
    # The groups that call another are handed this store's own (one statement cache, one registry pool).
    assert store.publishes.audited is store.jobs.audited is store.audited
    assert store.jobs.workers is store.workers
    assert store.replacing.jobs is store.jobs and store.replacing.publishes is store.publishes


def test_no_call_is_offered_by_two_parts_of_the_store(sqlite_url):
    store = Store(sqlite_url, "roles_")
    parts = [StoreEngine, *(type(group) for group in vars(store).values() if hasattr(group, "db"))]
    seen: dict[str, str] = {}
    for part in parts:
        for name in _calls(part):
            assert name not in seen, f"{name} is a call of both {seen[name]} and {part.__name__}"
            seen[name] = part.__name__
    # The store itself adds nothing to its engine's calls: every other call is a group's.
    assert _calls(Store) == _calls(StoreEngine)


# -- one writer at a time (SQLite) -----------------------------------------------------------
def test_threads_of_one_process_queue_for_a_sqlite_store_at_its_writer_lock(sqlite_url):
    """A second thread waits at the process's lock, not in SQLite's polling, and gives up
    within the bound with an error that names the holder."""
    store = Store(sqlite_url, "wl_", call_timeout=0.8)
    store.migrate()
    store.publishes.record("first", "t.x", "celery", None, 3)  # the schema check (a long call) is behind us
    with transaction_held(store):
        with pytest.raises(StoreUnavailable, match="another thread of this process held") as caught:
            store.publishes.record("queued", "t.x", "celery", None, 3)
        assert caught.value.kind == "timeout"
    store.publishes.record("queued", "t.x", "celery", None, 3)  # the turn comes once the holder is done
    assert store.get("queued").status == "pending"


def test_reads_of_a_sqlite_store_answer_while_a_writer_holds_it(sqlite_url):
    """Reads neither queue at the process's lock nor take SQLite's write lock: they see the last
    commit while a writer works (or while a frozen process holds the lock); writes still wait."""
    store = Store(sqlite_url, "wr_", call_timeout=0.8)
    store.migrate()
    store.publishes.record("committed", "t.x", "celery", None, 3)
    uncommitted = sa.update(store.t.jobs).values(queue_name="uncommitted")
    with transaction_held(store, lambda c: c.execute(uncommitted)):
        assert store.get("committed").queue_name == "celery"
        assert [e["event"] for e in store.reports.events("committed")] == ["published"]
        assert [job.id for job in store.reports.list_jobs(status=PENDING)] == ["committed"]
        with pytest.raises(StoreUnavailable):
            store.publishes.record("queued", "t.x", "celery", None, 3)
    assert store.get("committed").queue_name == "uncommitted"


def test_a_long_sqlite_transaction_waits_for_the_file_lock_with_the_long_bound(sqlite_url):
    """Another process holds the file's write lock past the call bound: a write gives up within
    it, a reaper batch or an operator's command waits on and gets its turn when the lock frees."""
    import sqlite3

    store = Store(sqlite_url, "wb_", call_timeout=0.8)
    store.migrate()
    store.publishes.record("first", "t.x", "celery", None, 3)
    other = sqlite3.connect(sa.make_url(sqlite_url).database, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # as a worker process in the middle of a write would
    outcome: list[object] = []
    began: list[float] = []

    def long_write() -> None:
        began.append(time.monotonic())
        try:
            with store.begin(long=True) as c:
                c.execute(sa.update(store.t.jobs).values(queue_name="long"))
            outcome.append("committed")
        except StoreUnavailable as exc:
            outcome.append(exc)

    second = Store(sqlite_url, "wb_", call_timeout=0.8)  # its own process lock, as another process
    waiter = threading.Thread(target=long_write)
    try:
        waiter.start()
        with pytest.raises(StoreUnavailable, match="database is locked"):
            second.publishes.record("short", "t.x", "celery", None, 3)  # gives up within the call bound
        short = store.bounds.lock_wait
        wait_for(lambda: (began and time.monotonic() - began[0] > 2 * short) or outcome,
                 message="the long transaction waiting past the short bound")
        assert waiter.is_alive() and not outcome  # still waiting, where a short one gave up
    finally:
        other.rollback()
        other.close()
        waiter.join(30)
    assert outcome == ["committed"] and store.get("first").queue_name == "long"
    store.publishes.record("after", "t.x", "celery", None, 3)  # a short write again on the same connection
    second.publishes.record("short", "t.x", "celery", None, 3)


def test_a_forked_process_gets_its_own_writer_lock(sqlite_url):
    store = Store(sqlite_url, "wf_")
    store.migrate()
    inherited = store._writer
    assert inherited is not None and inherited.acquire(timeout=1)  # held, as a parent thread might at fork
    store._pid = -1  # what the child sees: another pid than the one that built the engine
    store.publishes.record("child", "t.x", "celery", None, 3)
    assert store._writer is not inherited and store.get("child") is not None


def test_a_database_with_many_writers_has_no_writer_lock(store):
    store.publishes.record("any", "t.x", "celery", None, 3)
    assert (store._writer is None) is (not store.dialect.single_writer)


# -- SQLite's hot transitions on the driver ----------------------------------------------------
def _traced(store: Store) -> tuple[list[str], object]:
    """Every statement the store's pooled SQLite connections run from now on, values in place."""
    seen: list[str] = []

    def trace(dbapi_conn, _record, _proxy):
        dbapi_conn.set_trace_callback(seen.append)

    sa.event.listen(store.engine, "checkout", trace)
    return seen, trace


def test_a_sqlite_claim_and_completion_are_each_one_immediate_transaction_of_the_row_alone(sqlite_url):
    store = Store(sqlite_url, "hp_")
    store.migrate()
    store.publishes.record("hot", "t.task", "q", None, 3)
    seen, _ = _traced(store)
    tok = token()
    assert claim(store, "hot", tok=tok).claimed
    assert store.jobs.complete("hot", tok, "w1")
    writes = [s.split()[0].upper() + (" " + s.split()[1].upper() if s.upper().startswith("BEGIN") else "")
              for s in seen if not s.upper().startswith(("SELECT 1", "PRAGMA"))]
    assert writes == ["BEGIN IMMEDIATE", "UPDATE", "COMMIT"] * 2
    assert events(store, "hot") == ["published"]
    assert store.get("hot").status == COMPLETED


def test_a_sqlite_claim_and_completion_with_every_transition_audited_write_their_events(sqlite_url):
    store = Store(sqlite_url, "ha_", audit_every_transition=True)
    store.migrate()
    store.publishes.record("hot", "t.task", "q", None, 3)
    seen, _ = _traced(store)
    tok = token()
    assert claim(store, "hot", tok=tok).claimed
    assert store.jobs.complete("hot", tok, "w1")
    writes = [s.split()[0].upper() + (" " + s.split()[1].upper() if s.upper().startswith("BEGIN") else "")
              for s in seen if not s.upper().startswith(("SELECT 1", "PRAGMA"))]
    assert writes == ["BEGIN IMMEDIATE", "UPDATE", "INSERT", "COMMIT"] * 2
    assert events(store, "hot") == ["published", "claimed", "completed"]
    assert store.get("hot").status == COMPLETED


def test_a_sqlite_claim_returns_the_recovery_options_as_the_row_types_say(sqlite_url):
    """The driver's row is converted as SQLAlchemy would: a Boolean stored as 1 comes back True."""
    store = Store(sqlite_url, "hb_")
    store.migrate()
    store.publishes.record("typed", "t.task", "q", None, 3)
    terms = ClaimTerms(**TERMS, recovery={"backoff_jitter": True, "backoff_base": 2.5, "max_expirations": 4})
    won = store.jobs.claim("typed", "w1", token(), terms, task_name="t.task", queue="q", payload=lambda: None)
    assert won.job.backoff_jitter is True
    assert won.job.backoff_base == 2.5 and won.job.max_expirations == 4


def test_a_sqlite_claim_after_a_long_transaction_gives_up_within_the_short_bound(sqlite_url):
    """A reaper batch left its connection with the long busy timeout: the next claim on that
    connection sets the short one back before it asks for the write lock."""
    import sqlite3

    store = Store(sqlite_url, "hl_", call_timeout=0.8)
    store.migrate()
    store.publishes.record("after-long", "t.task", "q", None, 3)
    with store.begin(long=True) as c:
        c.execute(sa.update(store.t.jobs).values(queue_name="long"))
    other = sqlite3.connect(sa.make_url(sqlite_url).database, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process in the middle of a write
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable, match="database is locked"):
            claim(store, "after-long")
    finally:
        other.rollback()
        other.close()
    waited = time.monotonic() - started
    assert waited < store.long_bounds.lock_wait / 2, waited
    assert claim(store, "after-long").claimed  # and the connection is usable again


def test_a_sqlite_write_that_fails_midway_leaves_neither_its_rows_nor_the_write_lock(sqlite_url):
    """The job row went in, then its idempotency key collided: the write rolls its transaction
    back itself (here with the pool's reset on return turned off), so no half record stays and
    another process gets the write lock at once."""
    import sqlite3

    store = Store(sqlite_url, "hf_", call_timeout=0.8, engine_options={"pool_reset_on_return": None})
    store.migrate()
    assert store.publishes.record("first", "t.task", "q", None, 3, idempotency_key="k") == (True, "first")
    with store.begin() as c:  # the key's own row stays while the job's row goes (a pruned job)
        c.execute(sa.delete(store.t.jobs).where(store.t.jobs.c.id == "first"))
    assert store.publishes.record("second", "t.task", "q", None, 3, idempotency_key="k") == (False, "first")
    assert store.get("second") is None
    other = sqlite3.connect(sa.make_url(sqlite_url).database, isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")  # would raise "database is locked" if the store still held it
        other.rollback()
    finally:
        other.close()
