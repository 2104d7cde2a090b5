"""Resource locks held under a lease, on each store kind: waiting, expiry, renewal, loss and release."""
# ruff: noqa: F811 - the effect tests' fixtures are imported by name, and the tests' parameters shadow them

from __future__ import annotations

import secrets
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import sqlalchemy as sa

from celery_lease import deadline
from celery_lease.config import load
from celery_lease.errors import LeaseConfigError, LeaseError, LeaseLost, LockUnavailable, StoreUnavailable
from celery_lease.store import ClaimTerms, Store
from celery_lease.vocabulary import EffectOutcome, RunEnd
from celery_lease.worker.handles import DeferredWrite
from celery_lease.worker.lease import Lease
from celery_lease.worker.locks import lock
from celery_lease.worker.runtime import Runtime
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.tcp_proxy import TcpProxy
from tests.unit.test_effects import (  # noqa: F401 - fixtures and helpers shared with the effect tests
    _lost_during,
    claim,
    events,
    first_answer_lost,
    hb,
    lapse,
    policy,
    store,
)


def holder(store, resource: str):
    return store.reports.lock_holder(resource)


def test_a_second_holder_waits_for_release(store, hb):
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> None:
        with lock(a, "account:42", ttl=3.0):
            order.append("a in")
            entered.set()
            release.wait(10)
            order.append("a out")

    t = threading.Thread(target=hold)
    t.start()
    assert entered.wait(10)
    waiter = threading.Thread(target=lambda: _take(b, order))
    waiter.start()
    wait_for(lambda: waiter.is_alive(), message="waiter started")
    assert holder(store, "account:42")["job_id"] == "job-a"
    release.set()
    t.join(10)
    waiter.join(10)
    assert order == ["a in", "a out", "b in"]
    assert holder(store, "account:42") is None


def _take(lease: Lease, order: list[str]) -> None:
    with lock(lease, "account:42", ttl=3.0, timeout=10.0):
        order.append("b in")


def test_a_held_lock_raises_lock_unavailable_after_the_timeout(store, hb):
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")
    with lock(a, "account:42", ttl=3.0):
        started = time.monotonic()
        with pytest.raises(LockUnavailable, match="account:42"), lock(b, "account:42", timeout=0.3):
            pytest.fail("two holders")
        assert time.monotonic() - started >= 0.3
    with lock(b, "account:42", timeout=0):
        assert holder(store, "account:42")["job_id"] == "job-b"


def test_an_expired_lock_is_taken_and_audited(store, hb):
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")
    with lock(a, "account:42", ttl=3.0) as held_a:
        lk = store.t.locks
        with store.begin() as c:
            c.execute(sa.update(lk).values(expires_at=store.now_sql - store.clock_tolerance - 0.1))
        with lock(b, "account:42", timeout=0) as held_b:
            assert holder(store, "account:42")["token"] == held_b.token
        assert [e["reason"] for e in events(store, "lock_taken_after_expiry")] == ["account:42"]
    assert held_a.lost, "releasing a lock that moved on tells its holder"
    assert len(events(store, "lock_lost")) == 1


def test_a_lock_expired_by_less_than_the_clock_tolerance_is_not_taken(store, hb):
    # The holder's local margin is 1% of the TTL: a forward step of the store's clock within
    # lease_clock_tolerance must not hand its lock to another job while it still trusts it.
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")
    with lock(a, "account:42", ttl=3.0) as held:
        lk = store.t.locks
        with store.begin() as c:
            c.execute(sa.update(lk).values(expires_at=store.now_sql - store.clock_tolerance / 2))
        with pytest.raises(LockUnavailable):
            with lock(b, "account:42", timeout=0):
                pass
        assert holder(store, "account:42")["token"] == held.token
        with store.begin() as c:
            c.execute(sa.update(lk).values(expires_at=store.now_sql - store.clock_tolerance - 0.1))
        with lock(b, "account:42", timeout=0) as taken:
            assert holder(store, "account:42")["token"] == taken.token


def test_an_expired_looking_lock_is_not_taken_while_the_reapers_hold_covers_its_holder(store, hb):
    # After the store's clock stepped forward every lock looks expired, its holder not yet renewed: the
    # hold the reaper recorded covers it, as it covers a takeover claim of its job's lease.
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")
    with lock(a, "account:42", ttl=3.0) as held_a:
        lk = store.t.locks
        with store.begin() as c:
            # as the stepped clock shows it
            c.execute(sa.update(lk).values(expires_at=store.now_sql - store.clock_tolerance - 0.1))
        store.reaping.record_reaper_clock({"calm_since": store.now()}, held_back="clock stepped forward")
        with pytest.raises(LockUnavailable, match="account:42"), lock(b, "account:42", timeout=0):
            pytest.fail("two holders: the step made a held lock look expired")
        assert holder(store, "account:42")["token"] == held_a.token
        # Once the hold has covered job-a's lease and a heartbeat, the expired lock is taken as before.
        store.reaping.record_reaper_clock({"calm_since": store.now() - 3600.0})
        with lock(b, "account:42", timeout=0) as held_b:
            assert holder(store, "account:42")["token"] == held_b.token


def test_a_lock_whose_acquisition_answered_past_its_local_deadline_is_taken_again_before_the_block(
        store, hb, monkeypatch):
    # The first try's answer comes after the lock's TTL: by then another job may hold the row, so that
    # answer is not trusted and the block starts only under a lock with time left.
    lease = claim(store, hb, "job-a")
    real, late = store.effects.acquire_lock, []
    clock = {"skew": 0.0}  # the local clock, moved on by the answer's delay instead of waiting it out
    monkeypatch.setattr(deadline, "monotonic", lambda: time.monotonic() + clock["skew"])

    def slow_answer(*args, **kwargs):
        outcome = real(*args, **kwargs)
        if not late:
            late.append(outcome)
            clock["skew"] += 0.6  # the answer's delay: longer than the lock's 0.4 s TTL
        return outcome

    monkeypatch.setattr(store.effects, "acquire_lock", slow_answer)
    with lock(lease, "account:42", ttl=0.4, timeout=5.0) as held:
        assert deadline.monotonic() < held.deadline, "the block started under a lock past its deadline"
        held.check()
    assert late == [EffectOutcome.FIRST]


def test_a_lock_lost_to_another_owner_gives_its_jobs_lease_back(store, hb):
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")
    with lock(a, "account:42", ttl=3.0):
        lk = store.t.locks
        with store.begin() as c:
            c.execute(sa.update(lk).values(expires_at=store.now_sql - store.clock_tolerance - 0.1))
        with lock(b, "account:42", timeout=0):
            hb.beat()  # finds the lock taken: job-a's lease is lost here
            assert a.lost
            hb.beat()
            job = store.get("job-a")
            # Nobody else runs job-a: it is given back now, not left running for the reaper's hard grace.
            assert (job.status, job.lock_token) == ("pending", None)


def test_a_body_that_finished_after_its_lock_was_lost_is_not_given_back_when_its_completion_is_deferred(
        store, hb):
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")  # lease_on_lost="flag": the body goes on
    with lock(a, "account:42", ttl=3.0):
        with store.begin() as c:
            c.execute(sa.update(store.t.locks).values(expires_at=store.now_sql - store.clock_tolerance - 0.1))
        with lock(b, "account:42", timeout=0):
            hb.beat()  # the lock is found taken: job-a's lease lost, its give-back queued
            assert a.lost
    # The body returns; the store does not answer its completion, which is deferred to the heartbeat.
    completion = DeferredWrite(RunEnd.RETURNED, lambda: store.jobs.complete("job-a", a.token, hb.worker))
    hb.runtime.defer(a, completion)
    hb.beat()
    assert store.get("job-a").status == "completed", "the finished body was given back to run again"


def test_one_heartbeat_statement_renews_every_held_lock(store, hb):
    leases = [claim(store, hb, f"job-{i}") for i in range(3)]
    statements: list[str] = []

    def collect(conn, cursor, statement, parameters, context, executemany):
        if store.t.locks.name in statement:
            statements.append(statement.lstrip().split()[0].upper())

    with lock(leases[0], "r0", ttl=3.0), lock(leases[1], "r1", ttl=3.0), lock(leases[2], "r2", ttl=6.0):
        before = {r: holder(store, r)["expires_at"] for r in ("r0", "r1", "r2")}
        sa.event.listen(store.engine, "before_cursor_execute", collect)
        try:
            hb.beat()
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", collect)
        after = {r: holder(store, r)["expires_at"] for r in ("r0", "r1", "r2")}
    assert all(after[r] > before[r] for r in before)
    assert after["r2"] - after["r0"] == pytest.approx(3.0, abs=0.5)
    assert statements.count("UPDATE") == 1 and "DELETE" not in statements


def test_locks_of_a_lost_lease_are_released_by_the_heartbeat(store, hb):
    lease = claim(store, hb, "job-1")
    hb.runtime.attach(object(), lease)
    with lock(lease, "account:42", ttl=3.0):
        lapse(store, "job-1")
        claim(store, hb, "job-1")
        hb.beat()
        assert lease.lost
        assert holder(store, "account:42") is None


def test_a_loss_held_back_while_a_lock_is_taken_releases_the_lock(store, hb):
    # The row was committed before the loss landed: released at once, not left held for its ttl.
    lease = claim(store, hb, "job-1", lease_on_lost="raise")
    hb.runtime.attach(object(), lease)
    _lost_during(store, lease, "acquire_lock")
    caught = []

    def body() -> None:
        try:
            with lease.body(), lock(lease, "account:42", ttl=30.0):
                caught.append("ran")
        except LeaseLost as exc:
            caught.append(exc.reason)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join(10)
    assert caught == ["local deadline passed during the call"]
    assert holder(store, "account:42") is None
    assert not hb.runtime.locks.holds("job-1", "account:42")


def test_a_lock_taken_by_a_try_whose_answer_was_lost_is_the_retrys(store, hb):
    # The first try committed but its answer never came (a dropped connection): the retry finds its own
    # row and holds it, instead of waiting for itself until LockUnavailable.
    lease = claim(store, hb, "job-1")
    tries = first_answer_lost(store.effects, "_acquire_lock_once")
    with lock(lease, "account:42", ttl=3.0, timeout=1.0) as held:
        assert holder(store, "account:42")["token"] == held.token
    assert len(tries) == 2 and holder(store, "account:42") is None


def test_a_lock_release_whose_answer_was_lost_is_not_audited_as_a_lost_lock(store, hb):
    # The release committed but its answer never came: the heartbeat's next try deletes nothing, the
    # first try's own delete, not a lock that expired and moved on.
    lease = claim(store, hb, "job-1")
    tries = first_answer_lost(store.effects, "release_lock")
    with lock(lease, "account:42", ttl=3.0):
        pass
    assert holder(store, "account:42") is None and len(tries) == 1
    hb.beat()
    assert tries == [True, False]
    assert not events(store, "lock_lost") and not lease.lost


@pytest.mark.parametrize("audit", ["written", "refused"])
def test_a_lock_lost_to_another_owner_marks_the_lease_lost(store, hb, monkeypatch, audit):
    # Refused: the store does not take the lock_lost audit; the lease is marked lost all the same.
    a, b = claim(store, hb, "job-a"), claim(store, hb, "job-b")
    with lock(a, "account:42", ttl=3.0) as held:
        lk = store.t.locks
        with store.begin() as c:
            c.execute(sa.update(lk).values(expires_at=store.now_sql - store.clock_tolerance - 0.1))
        with lock(b, "account:42", timeout=0):
            if audit == "refused":
                def refused(*args, **kwargs):
                    raise StoreUnavailable("store unreachable for the audit")

                monkeypatch.setattr(store, "event", refused)
            hb.beat()
            monkeypatch.undo()
            assert held.lost and a.lost
            with pytest.raises(LeaseLost, match="account:42"):
                held.check()
            assert holder(store, "account:42")["job_id"] == "job-b"


def test_a_stale_lease_cannot_take_a_lock_and_the_refusal_is_audited(store, hb):
    stale = claim(store, hb, "job-1")
    lapse(store, "job-1")
    claim(store, hb, "job-1")
    with pytest.raises(LeaseLost), lock(stale, "account:42", timeout=0):
        pytest.fail("a stale owner must not lock")
    assert holder(store, "account:42") is None
    rejected = events(store, "stale_lock_rejected")
    assert [(e["job_id"], e["token"], e["worker"]) for e in rejected] == [
        ("job-1", stale.token[:8], hb.worker)]


def test_locks_are_not_reentrant_and_need_a_ttl_of_two_heartbeats(store, hb):
    lease = claim(store, hb, "job-1")  # heartbeat interval 0.2 s
    with lock(lease, "account:42", ttl=3.0), pytest.raises(LeaseError, match="not re-entrant"), \
            lock(lease, "account:42"):
        pass
    with pytest.raises(LeaseConfigError, match=r"lease_lock_ttl.*two heartbeat intervals"), \
            lock(lease, "account:43", ttl=0.39):
        pass
    with lock(lease, "account:43", ttl=0.4) as held:
        assert held.ttl == 0.4


def test_a_lock_ttl_defaults_to_the_leases_duration(store, hb):
    lease = claim(store, hb, "job-1", lease_duration=12.0)
    with lock(lease, "account:42") as held:
        left = holder(store, "account:42")["expires_at"] - store.now()
    assert held.ttl == 12.0
    assert 11.0 < left <= 12.0


def test_a_lock_past_its_local_deadline_is_refused_without_asking_the_store(store, hb, monkeypatch):
    lease = claim(store, hb, "job-1")
    hb.runtime.attach(object(), lease)
    sent = deadline.monotonic()
    with lock(lease, "account:42", ttl=3.0) as held:
        held.check()  # within its deadline
        statements: list[str] = []

        def collect(conn, cursor, statement, parameters, context, executemany):
            statements.append(statement)

        sa.event.listen(store.engine, "before_cursor_execute", collect)
        try:
            # When the lock's TTL has passed on the local clock since its acquisition was sent
            monkeypatch.setattr(deadline, "monotonic", lambda: sent + 3.0)
            # Then the lock and the job's lease are refused, and nothing asked the store
            with pytest.raises(LeaseLost, match="account:42"):
                held.check()
            with pytest.raises(LeaseLost, match="past its local deadline"):
                lease.check()
            assert statements == []
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", collect)
    assert holder(store, "account:42") is None, "the block's exit still releases the row"


def test_a_renewal_moves_a_locks_deadline_from_its_send_time(store, hb, monkeypatch):
    lease = claim(store, hb, "job-1")
    with lock(lease, "account:42", ttl=3.0) as held:
        first = held.deadline
        before = deadline.monotonic()
        hb.beat()
        after = deadline.monotonic()
    assert first < held.deadline
    assert deadline.local_deadline(before, 3.0) <= held.deadline <= deadline.local_deadline(after, 3.0)


def test_a_lock_ttl_under_two_heartbeats_is_refused_when_the_settings_are_loaded():
    assert load({}).policy().lock_ttl is None  # None: the lease's duration
    with pytest.raises(LeaseConfigError, match=r"lease_lock_ttl.*two heartbeat intervals"):
        load({"lease_lock_ttl": 15.0, "lease_heartbeat_interval": 10.0})
    with pytest.raises(LeaseConfigError, match="lease_lock_ttl"):
        load({}).policy({"lease_lock_ttl": 1.0, "lease_heartbeat_interval": 1.0})
    assert load({"lease_lock_ttl": 20.0}).policy().lock_ttl == 20.0


@pytest.fixture
def black_holed(postgres_url):
    """The same PostgreSQL tables reached directly and through a forwarder the test can freeze."""
    pg = urlsplit(postgres_url)
    direct = Store(postgres_url, prefix=unique_prefix())
    direct.migrate()
    direct.hard_grace = 0.0
    proxy = TcpProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start()
    cut_off = Store(urlunsplit(pg._replace(netloc=f"{pg.username}@127.0.0.1:{proxy.port}")),
                    prefix=direct.prefix, call_timeout=3.0)
    yield proxy, direct, cut_off
    proxy.thaw()
    proxy.cut()
    cut_off.engine.dispose()
    direct.drop_schema()
    direct.engine.dispose()


def _claimed(store, rt: Runtime, job_id: str, **overrides) -> Lease:
    # The store's lease and the worker's agree on the duration, as a real claim's do.
    terms = policy(**overrides)
    store.publishes.record(job_id, "t.pay", "q", "{}", 5)
    tok, sent = secrets.token_hex(16), deadline.monotonic()
    got = store.jobs.claim(job_id, rt.worker, tok,
                           ClaimTerms(duration=terms.duration, grace=0.0, max_attempts=5, max_expirations=5,
                                      takeover=True),
                           task_name="t.pay", queue="q", payload=lambda: None)
    assert got.claimed, got
    return Lease(rt, job_id, tok, 1, terms, f"t.pay:{job_id}", None, sent_at=sent)


def test_a_holder_cut_off_from_the_store_stops_trusting_its_lock_before_another_job_takes_it(black_holed):
    proxy, direct, cut_off = black_holed
    # Given a body holding a 1.5 s lock under a 30 s lease, renewed every 0.5 s through a forwarder
    rt = Runtime(cut_off, "host", default_interval=0.5, worker="holder:1")
    other_rt = Runtime(direct, "host", default_interval=0.5, worker="other:2")
    other_rt.start = lambda: None
    held_by = _claimed(cut_off, rt, "job-a", lease_heartbeat_interval=0.5, lease_on_lost="raise")
    # (job-b's runtime never renews: a long lease keeps it trusted however slow the machine)
    other = _claimed(direct, other_rt, "job-b", lease_heartbeat_interval=0.5, lease_duration=300.0)
    acquired, passes, stopped = threading.Event(), [], []

    def body() -> None:
        try:
            with held_by.body(), lock(held_by, "account:42", ttl=1.5) as held:
                acquired.set()
                end = time.monotonic() + 15
                while time.monotonic() < end:
                    held.check()
                    held_by.check()
                    passes.append(time.monotonic())
                    time.sleep(0.01)
        except LeaseLost as exc:
            stopped.append(str(exc))

    worker = threading.Thread(target=body)
    try:
        rt.attach(object(), held_by)
        worker.start()
        assert acquired.wait(10)
        beats = rt.heartbeat.beats
        wait_for(lambda: rt.heartbeat.beats >= beats + 2, timeout=10, message="no renewals")
        # When the path to the store drops every byte (nothing answers, nothing is refused)
        proxy.freeze()
        # Then another job takes the lock once it expired in the store ...
        with lock(other, "account:42", timeout=10.0):
            taken = time.monotonic()
        # ... and the holder's body had stopped trusting the lock and its lease before that
        assert passes, "the body never checked its lock"
        assert max(passes) < taken, f"check() passed {max(passes) - taken:.2f}s after the other job took it"
        wait_for(lambda: stopped, timeout=10, message="the body was never stopped")
        assert held_by.lost and "account:42" in held_by.lost_reason
    finally:
        proxy.thaw()
        worker.join(20)
        rt.stop()


def test_resources_named_like_the_reapers_lock_are_refused(store, hb):
    lease = claim(store, hb, "job-1")
    with pytest.raises(ValueError, match="reserved"), lock(lease, "celery_lease.reaper", ttl=3.0):
        pass
