"""Fenced effects, idempotency keys, checkpoints, resource locks and advance, on each store kind."""

from __future__ import annotations

import secrets
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import sqlalchemy as sa
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from celery_lease import deadline
from celery_lease.config import load
from celery_lease.errors import LeaseConfigError, LeaseError, LeaseLost, LockUnavailable, StoreUnavailable
from celery_lease.store import ClaimTerms, Store
from celery_lease.vocabulary import EffectOutcome, RunEnd
from celery_lease.worker.effects import advance, effect, lock
from celery_lease.worker.handles import DeferredWrite
from celery_lease.worker.lease import Lease
from celery_lease.worker.runtime import Runtime
from celery_lease.worker.threads import Heartbeat
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.tcp_proxy import TcpProxy

RACERS = 16


def policy(**overrides):
    return load({}).policy({"lease_duration": 30.0, "lease_heartbeat_interval": 0.2,
                            "lease_on_lost": "flag", **overrides})


@pytest.fixture
def store(store):
    """The shared store with no hard grace: a lapsed lease is taken over even from a live worker."""
    store.hard_grace = 0.0
    return store


def claim(store, hb: Heartbeat, job_id: str, **overrides) -> Lease:
    """Record (if new) and claim ``job_id``; a lapsed lease is taken over. Returns the new owner's Lease."""
    store.publishes.record(job_id, "t.pay", "q", "{}", 5)
    tok = secrets.token_hex(16)
    sent = deadline.monotonic()
    got = store.jobs.claim(job_id, hb.worker, tok,
                           ClaimTerms(duration=3.0, grace=0.0, max_attempts=5, max_expirations=5,
                                      takeover=True),
                           task_name="t.pay", queue="q", payload=lambda: None)
    assert got.claimed, got
    job = got.job
    return Lease(hb.runtime, job_id, tok, job.attempt_count, policy(**overrides),
                 job.idempotency_key or f"t.pay:{job_id}", job.checkpoint_state(), sent_at=sent)


def lapse(store, job_id: str) -> None:
    """Put a lease's expiry in the past on the store's clock (test-only SQL)."""
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lease_expires_at=store.now_sql - 1.0))


def keys(store) -> dict[str, str]:
    e = store.t.effects
    with store.begin() as c:
        return {r.key: r.job_id for r in c.execute(sa.select(e))}


def events(store, name: str) -> list[dict]:
    return store.reports.events(event=name)


@pytest.fixture
def hb(store):
    rt = Runtime(store, "host", default_interval=0.2, worker="host:1")
    rt.start = lambda: None  # rounds driven by hand
    yield rt.heartbeat
    rt.stop()


@pytest.fixture
def ledger(store):
    """A business table in the store's database, with a unique business key."""
    md = sa.MetaData()
    table = sa.Table(f"{store.t.jobs.name[:-4]}ledger", md,
                     sa.Column("payment_id", sa.String(64), primary_key=True),
                     sa.Column("amount", sa.Integer, nullable=False))
    md.create_all(store.engine)
    yield table
    md.drop_all(store.engine)


def first_answer_lost(statements, name: str) -> list:
    """Make the first call of ``statements.name`` commit and then raise as a dropped connection would;
    returns the list of the calls' outcomes."""
    real, tries = getattr(statements, name), []

    def answer_lost(*args, **kwargs):
        outcome = real(*args, **kwargs)
        tries.append(outcome)
        if len(tries) == 1:
            raise StoreUnavailable("connection dropped before the answer")
        return outcome

    setattr(statements, name, answer_lost)
    return tries


def race(n: int, fn) -> list:
    """Run ``fn(i)`` in n threads released together; returns results (exceptions included)."""
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - the test inspects every outcome
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# -- fenced effects ------------------------------------------------------------------------
def test_sixteen_leases_racing_on_one_effect_key_see_first_once(store, hb):
    leases = [claim(store, hb, f"job-{i}") for i in range(RACERS)]

    def attempt(i: int) -> bool:
        with effect(leases[i], "capture:p1") as first:
            return first

    results = race(RACERS, attempt)
    assert sorted(results, key=str) == [False] * (RACERS - 1) + [True]
    winner = leases[results.index(True)].job_id
    assert keys(store) == {"capture:p1": winner}


def test_sixteen_leases_racing_in_their_own_transactions_write_one_ledger_row(store, hb, ledger):
    leases = [claim(store, hb, f"job-{i}") for i in range(RACERS)]
    engine = sa.create_engine(store.url, poolclass=sa.NullPool,
                              connect_args={"timeout": 30} if store.dialect.name == "sqlite" else {})

    def attempt(i: int) -> bool:
        with engine.begin() as conn:
            with effect(leases[i], "capture:p1", connection=conn) as first:
                if first:
                    conn.execute(ledger.insert().values(payment_id="p1", amount=100 + i))
                return first

    results = race(RACERS, attempt)
    assert [r for r in results if not isinstance(r, bool)] == []
    assert results.count(True) == 1
    with store.begin() as c:
        rows = c.execute(sa.select(ledger)).all()
    assert rows == [("p1", 100 + results.index(True))]
    assert keys(store) == {"capture:p1": leases[results.index(True)].job_id}


def test_successive_owners_after_takeovers_see_first_once(store, hb):
    seen = []
    for _ in range(3):
        lease = claim(store, hb, "job-1")
        with effect(lease, "ship:o1") as first:
            seen.append((lease.attempt, first))
        lapse(store, "job-1")
    assert seen == [(1, True), (2, False), (3, False)]


def test_effect_with_a_stale_token_writes_nothing_and_raises_lease_lost(store, hb):
    stale = claim(store, hb, "job-1")
    lapse(store, "job-1")
    fresh = claim(store, hb, "job-1")
    with pytest.raises(LeaseLost), effect(stale, "capture:p1") as first:
        pytest.fail(f"body ran with first={first}")
    assert keys(store) == {}
    assert stale.lost and not fresh.lost
    rejected = events(store, "stale_effect_rejected")
    assert [(e["job_id"], e["token"]) for e in rejected] == [("job-1", stale.token[:8])]
    with effect(fresh, "capture:p1") as first:
        assert first


def test_effect_with_a_stale_token_in_a_user_transaction_writes_nothing(store, hb, ledger):
    stale = claim(store, hb, "job-1")
    lapse(store, "job-1")
    claim(store, hb, "job-1")
    with pytest.raises(LeaseLost), store.engine.begin() as conn, \
            effect(stale, "capture:p1", connection=conn):
        conn.execute(ledger.insert().values(payment_id="p1", amount=1))
    assert keys(store) == {}
    with store.begin() as c:
        assert c.execute(sa.select(ledger)).all() == []


def test_stale_token_is_refused_even_when_the_key_exists(store, hb):
    stale = claim(store, hb, "job-1")
    lapse(store, "job-1")
    fresh = claim(store, hb, "job-1")
    with effect(fresh, "capture:p1") as first:
        assert first
    with pytest.raises(LeaseLost), effect(stale, "capture:p1"):
        pytest.fail("a stale owner must not run the block")
    assert keys(store) == {"capture:p1": "job-1"}


def test_a_lease_known_lost_raises_before_touching_the_store(store, hb):
    lease = claim(store, hb, "job-1")
    lease.mark_lost("taken_over", "other:2")
    with pytest.raises(LeaseLost, match="other:2"), effect(lease, "k"):
        pytest.fail("no block after a known loss")
    assert keys(store) == {} and events(store, "stale_effect_rejected") == []


def test_effect_in_a_user_transaction_that_rolls_back_leaves_no_key(store, hb, ledger):
    lease = claim(store, hb, "job-1")
    with pytest.raises(ZeroDivisionError), store.engine.begin() as conn:
        with effect(lease, "capture:p1", connection=conn) as first:
            assert first
            conn.execute(ledger.insert().values(payment_id="p1", amount=5))
        assert keys_on(conn, store) == {"capture:p1": "job-1"}
        raise ZeroDivisionError("the business transaction fails after the block")
    assert keys(store) == {}
    with store.begin() as c:
        assert c.execute(sa.select(ledger)).all() == []
    with store.engine.begin() as conn, effect(lease, "capture:p1", connection=conn) as first:
        assert first, "the rolled-back effect is performed by the next try"


def keys_on(conn, store) -> dict[str, str]:
    return {r.key: r.job_id for r in conn.execute(sa.select(store.t.effects))}


def test_effect_in_a_user_transaction_commits_with_the_business_row(store, hb, ledger):
    lease = claim(store, hb, "job-1")
    with store.engine.begin() as conn, effect(lease, "capture:p1", connection=conn) as first:
        assert first
        conn.execute(ledger.insert().values(payment_id="p1", amount=5))
    with store.begin() as c:
        assert c.execute(sa.select(ledger)).all() == [("p1", 5)]
    assert keys(store) == {"capture:p1": "job-1"}


def test_an_open_effect_transaction_does_not_hold_up_the_heartbeat(store, hb):
    if store.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer at a time: every store write waits for the open transaction")
    lease = claim(store, hb, "job-1")
    renewed = threading.Event()
    with store.engine.begin() as conn, effect(lease, "capture:p1", connection=conn) as first:
        assert first
        threading.Thread(target=lambda: store.jobs.renew({lease.token: "job-1"}, hb.worker) and renewed.set(),
                         daemon=True).start()
        assert renewed.wait(5), "the renewal waited for the effect's transaction (a lock on the jobs row)"


def test_a_duplicate_key_leaves_the_user_transaction_usable(store, hb, ledger):
    lease = claim(store, hb, "job-1")
    with effect(lease, "capture:p1") as first:
        assert first
    with store.engine.begin() as conn:
        with effect(lease, "capture:p1", connection=conn) as first:
            assert not first
        conn.execute(ledger.insert().values(payment_id="after-duplicate", amount=1))
    with store.begin() as c:
        assert c.execute(sa.select(ledger.c.payment_id)).scalars().all() == ["after-duplicate"]


def test_a_failing_block_in_a_committed_transaction_takes_its_key_back(store, hb):
    lease = claim(store, hb, "job-1")
    with store.engine.begin() as conn:
        with pytest.raises(TimeoutError), effect(lease, "capture:p1", connection=conn) as first:
            assert first
            raise TimeoutError("gateway timed out")
    assert keys(store) == {}


def test_a_failing_block_releases_its_key_for_the_next_attempt(store, hb):
    lease = claim(store, hb, "job-1")
    with pytest.raises(ConnectionError), effect(lease, "capture:p1") as first:
        assert first
        raise ConnectionError("gateway down")
    assert keys(store) == {}
    assert [e["detail"] for e in events(store, "effect_released")] == ['{"key": "capture:p1"}']
    with effect(lease, "capture:p1") as first:
        assert first
    with effect(lease, "capture:p1") as first:
        assert not first


@pytest.mark.parametrize("interruption", [SoftTimeLimitExceeded, TimeLimitExceeded, KeyboardInterrupt])
def test_a_block_ended_from_outside_keeps_its_key_and_is_audited(store, hb, interruption):
    # Celery's soft limit (and a SIGUSR1 revoke), a gevent pool's hard limit, a greenlet's kill or a
    # shutdown land after the effect as well as before it: given back, the next attempt would do it again.
    lease = claim(store, hb, "job-1")
    done: list[str] = []
    with pytest.raises(interruption), effect(lease, "mail:1") as first:
        assert first
        done.append("mail sent")
        raise interruption()
    assert keys(store) == {"mail:1": "job-1"} and events(store, "effect_released") == []
    unconfirmed = events(store, "effect_unconfirmed")
    assert len(unconfirmed) == 1 and interruption.__name__ in unconfirmed[0]["reason"]
    with effect(claim(store, hb, "job-2"), "mail:1") as first:  # another run of the same effect
        if first:
            done.append("mail sent")
    assert done == ["mail sent"]


def test_a_block_interrupted_by_its_lost_lease_keeps_its_key_and_is_audited(store, hb):
    # The interruption lands wherever the block is: after a payment call returned as well as before it.
    # A key given back then would let the next attempt charge again, so it stays (at most once) and
    # effect_unconfirmed names it for an operator, although the store still carries the token.
    lease = claim(store, hb, "job-1", lease_on_lost="raise")
    inside, caught = threading.Event(), []

    def body() -> None:
        try:
            with lease.body(), effect(lease, "capture:p1") as first:
                assert first
                inside.set()
                end = time.monotonic() + 10
                while time.monotonic() < end:
                    sum(range(100))
        except LeaseLost as exc:
            caught.append(exc.reason)

    worker = threading.Thread(target=body)
    worker.start()
    assert inside.wait(10)
    lease.mark_lost("local deadline passed")
    worker.join(10)
    assert caught == ["local deadline passed"]
    assert keys(store) == {"capture:p1": "job-1"}
    assert events(store, "effect_released") == []
    unconfirmed = events(store, "effect_unconfirmed")
    assert len(unconfirmed) == 1 and "capture:p1" in unconfirmed[0]["detail"]
    with effect(claim(store, hb, "job-2"), "capture:p1") as first:
        assert not first  # nobody performs it again


def _lost_during(store, lease: Lease, verb: str) -> None:
    """The lease is marked lost while the store call ``verb`` is out (it commits, then the loss is due)."""
    real = getattr(store.effects, verb)

    def call(*args, **kwargs):
        answer = real(*args, **kwargs)
        # From another thread, as the deadline timer or the heartbeat finds it.
        timer = threading.Thread(target=lease.mark_lost, args=("local deadline passed during the call",))
        timer.start()
        timer.join(10)
        return answer

    setattr(store.effects, verb, call)


def test_a_loss_held_back_while_an_effects_key_is_recorded_gives_the_key_back(store, hb):
    # The block never runs, so the key it recorded goes back: a later attempt performs the effect.
    lease = claim(store, hb, "job-1", lease_on_lost="raise")
    _lost_during(store, lease, "record_effect")
    ran, caught = [], []

    def body() -> None:
        try:
            with lease.body(), effect(lease, "mail:1") as first:
                ran.append(first)
        except LeaseLost as exc:
            caught.append(exc.reason)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join(10)
    assert ran == [] and caught == ["local deadline passed during the call"]
    assert keys(store) == {}
    assert [e["detail"] for e in events(store, "effect_released")] == ['{"key": "mail:1"}']


def test_a_block_failing_after_the_lease_moved_on_keeps_its_key_and_is_audited(store, hb):
    lease = claim(store, hb, "job-1")
    with pytest.raises(ConnectionError), effect(lease, "capture:p1") as first:
        assert first
        lapse(store, "job-1")
        claim(store, hb, "job-1")
        raise ConnectionError("gateway down")
    assert keys(store) == {"capture:p1": "job-1"}
    unconfirmed = events(store, "effect_unconfirmed")
    assert len(unconfirmed) == 1 and "capture:p1" in unconfirmed[0]["detail"]


def test_an_effect_recorded_by_a_try_whose_answer_was_lost_runs_once(store, hb):
    # The first try committed the key but its answer never came (a dropped connection): the retry finds
    # the key under its own call's nonce and runs the block, instead of skipping an effect never done.
    lease = claim(store, hb, "job-1")
    tries = first_answer_lost(store.effects, "record_effect")
    with effect(lease, "mail:1") as first:
        assert first
    del store.effects.record_effect
    with effect(lease, "mail:1") as again:  # a second call in the same run is another call: a duplicate
        assert not again
    assert len(tries) == 2 and keys(store) == {"mail:1": "job-1"}


def test_a_later_attempt_does_not_take_an_earlier_attempts_key_for_its_own(store, hb):
    first_owner = claim(store, hb, "job-1")
    with effect(first_owner, "mail:1") as first:
        assert first
    lapse(store, "job-1")
    second_owner = claim(store, hb, "job-1")
    with effect(second_owner, "mail:1") as first:
        assert not first


def test_a_store_on_the_previous_revision_records_effect_keys_without_their_nonce(store_factory):
    # A rolling deploy runs this release on revision 0007's schema (no nonce column) until `lease migrate`.
    old = store_factory(migrate=False, reuse=False)
    old.migrate(to="0007")
    old.publishes.record("job-1", "t.pay", "q", "{}", 5)
    token = secrets.token_hex(16)
    assert old.jobs.claim("job-1", "host:1", token, ClaimTerms(duration=3.0, grace=0.0, max_attempts=5,
                                                              max_expirations=5, takeover=True),
                          task_name="t.pay", queue="q", payload=lambda: None).claimed
    assert old.effects.record_effect("mail:1", "job-1", token, "host:1", "a" * 32) == EffectOutcome.FIRST
    assert old.effects.record_effect("mail:1", "job-1", token, "host:1", "a" * 32) == EffectOutcome.DUPLICATE
    assert old.reports.effect_record("mail:1")["job_id"] == "job-1"


def test_keys_differing_only_in_case_are_distinct_effects(store, hb):
    lease = claim(store, hb, "job-1")
    for key in ("ch_1Ab", "ch_1aB"):
        with effect(lease, key) as first:
            assert first, key


@pytest.mark.parametrize("key", ["", "x" * 256, None])
def test_effect_keys_are_bounded_non_empty_strings(store, hb, key):
    lease = claim(store, hb, "job-1")
    with pytest.raises(ValueError, match="at most 255"), effect(lease, key):
        pass


def test_an_operator_can_forget_an_unconfirmed_effect(store, hb):
    lease = claim(store, hb, "job-1")
    with effect(lease, "capture:p1"):
        pass
    assert store.reports.effect_keys("job-1") == ["capture:p1"]
    assert store.recovery.forget_effect("capture:p1", "gateway shows no capture")
    assert not store.recovery.forget_effect("capture:p1")
    assert store.reports.effect_keys("job-1") == [] and len(events(store, "effect_forgotten")) == 1


def test_a_forget_that_spares_live_leases_leaves_the_key_of_a_job_whose_lease_is_live(store, hb):
    lease = claim(store, hb, "job-1")
    with effect(lease, "capture:p1"):
        pass
    at = store.reports.effect_record("capture:p1")["at"]
    assert not store.recovery.forget_effect("capture:p1", live=False)
    assert not store.recovery.forget_effect("capture:p1", recorded=("job-2", at))  # not the record shown
    assert store.reports.effect_keys("job-1") == ["capture:p1"] and events(store, "effect_forgotten") == []
    assert store.recovery.forget_effect("capture:p1", recorded=("job-1", at))


# -- idempotent publish, redrive, checkpoints -----------------------------------------------
def test_sixteen_threads_recording_one_idempotency_key_make_one_job(store):
    results = race(RACERS, lambda i: store.publishes.record(f"job-{i}", "t.pay", "q", "{}", 5,
                                                            idempotency_key="order-1"))
    assert [r for r in results if not isinstance(r, tuple)] == []
    created = [holder for made, holder in results if made]
    assert len(created) == 1
    assert {holder for _, holder in results} == set(created)
    with store.begin() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(store.t.jobs)).scalar() == 1


def test_a_checkpoint_is_read_by_the_next_attempt(store, hb):
    first = claim(store, hb, "job-1")
    assert first.checkpoint_state is None
    first.checkpoint({"step": 2, "charged": ["p1"]})
    lapse(store, "job-1")
    second = claim(store, hb, "job-1")
    assert second.attempt == 2 and second.checkpoint_state == {"step": 2, "charged": ["p1"]}
    assert second.idempotency_key == first.idempotency_key == "t.pay:job-1"


def test_a_stale_checkpoint_writes_nothing_and_raises_lease_lost(store, hb):
    stale = claim(store, hb, "job-1")
    stale.checkpoint({"step": 1})
    lapse(store, "job-1")
    claim(store, hb, "job-1")
    with pytest.raises(LeaseLost):
        stale.checkpoint({"step": 9})
    assert store.get("job-1").checkpoint_state() == {"step": 1}
    assert len(events(store, "stale_checkpoint_rejected")) == 1


def test_the_idempotency_key_given_at_publish_is_the_leases(store, hb):
    store.publishes.record("job-1", "t.pay", "q", "{}", 5, idempotency_key="order-1")
    assert claim(store, hb, "job-1").idempotency_key == "order-1"


# -- resource locks -------------------------------------------------------------------------
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


# -- advance ----------------------------------------------------------------------------------------
STATES = ["new", "paid", "shipped", "delivered"]


@pytest.fixture
def orders(store):
    md = sa.MetaData()
    table = sa.Table(f"{store.t.jobs.name[:-4]}orders", md,
                     sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
                     sa.Column("status", sa.String(16)), sa.Column("seq", sa.Integer))
    md.create_all(store.engine)
    with store.engine.begin() as c:
        c.execute(table.insert().values(id=1, status="paid", seq=None))
    yield table
    md.drop_all(store.engine)


def test_advance_moves_a_state_forward_only(store, orders):
    with store.engine.begin() as c:
        assert advance(c, orders.c.status, orders.c.id == 1, "shipped", order=STATES)
        assert not advance(c, orders.c.status, orders.c.id == 1, "shipped", order=STATES), "a replay"
        assert not advance(c, orders.c.status, orders.c.id == 1, "paid", order=STATES), "a late message"
        assert c.execute(sa.select(orders.c.status)).scalar() == "shipped"
    with pytest.raises(ValueError, match="refunded"), store.engine.begin() as c:
        advance(c, orders.c.status, orders.c.id == 1, "refunded", order=STATES)


def test_advance_keeps_the_highest_value(store, orders):
    with store.engine.begin() as c:
        moved = [advance(c, orders.c.seq, orders.c.id == 1, v) for v in (3, 7, 5, 7)]
        assert moved == [True, True, False, False]
        assert c.execute(sa.select(orders.c.seq)).scalar() == 7
