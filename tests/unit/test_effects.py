"""Fenced effects, idempotency keys, checkpoints and advance, on each store kind."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import sqlalchemy as sa
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from celery_lease import deadline
from celery_lease.config import load
from celery_lease.errors import LeaseLost, StoreUnavailable
from celery_lease.store import ClaimTerms
from celery_lease.worker.effects import advance, effect
from celery_lease.worker.lease import Lease
from celery_lease.worker.runtime import Runtime
from celery_lease.worker.threads import Heartbeat

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


def test_an_effect_on_a_connection_in_autocommit_is_refused_and_records_no_key(store, hb):
    # Each statement commits alone there: the key would commit before the block, and a crash before the
    # block's writes would lose the effect for good.
    lease = claim(store, hb, "job-1")
    with store.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(ValueError, match=r"AUTOCOMMIT.*engine\.begin"), \
                effect(lease, "capture:p1", connection=conn):
            pytest.fail("the block ran")
    assert keys(store) == {}


@pytest.fixture
def other_database(store, tmp_path):
    """An engine on another database of the store's kind holding copies of its jobs and effects tables (a
    Django alias other than the store's, where the store's tables were once migrated)."""
    url = store.engine.url
    admin = None
    if url.get_backend_name() == "sqlite":
        other = url.set(database=str(tmp_path / "other.sqlite3"))
    elif url.get_backend_name() == "postgresql":
        other = url.set(database="postgres")
    else:
        name = f"other_{store.prefix}".rstrip("_")
        admin = sa.create_engine(url)
        with admin.begin() as c:
            c.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS {name}")
        other = url.set(database=name)
    engine = sa.create_engine(other)
    tables = [store.t.jobs, store.t.effects]
    store.t.jobs.metadata.create_all(engine, tables=tables)
    yield engine
    store.t.jobs.metadata.drop_all(engine, tables=tables)
    engine.dispose()
    if admin is not None:
        with admin.begin() as c:
            c.exec_driver_sql(f"DROP DATABASE IF EXISTS {other.database}")
        admin.dispose()


def test_an_effect_on_a_connection_to_another_database_is_refused_not_taken_for_a_duplicate(
        store, hb, other_database):
    # The fenced insert there finds no such job and writes nothing; the store says the lease is held, so the
    # block was skipped as a duplicate and the effect never happened.
    lease = claim(store, hb, "job-1")
    with pytest.raises(ValueError, match=r"does not hold job job-1: it is another database"), \
            other_database.begin() as conn, effect(lease, "capture:p1", connection=conn):
        pytest.fail("the block ran against another database")
    assert keys(store) == {}


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


@pytest.mark.parametrize("landing", ["soft time limit", "lease taken over"])
def test_a_key_recorded_by_a_call_ended_before_its_block_goes_back_to_later_attempts(store, hb, landing):
    # The key committed; then, before the block: Celery's soft limit lands in the call, or the lease is
    # taken over (the token no longer fences a release). Either way the block never ran.
    lease = claim(store, hb, "job-1")
    real, owners = store.effects.record_effect, []

    def recorded_then(*args, **kwargs):
        outcome = real(*args, **kwargs)
        if landing == "soft time limit":
            raise SoftTimeLimitExceeded()
        lapse(store, "job-1")
        owners.append(claim(store, hb, "job-1"))
        lease.mark_lost("taken over")
        return outcome

    store.effects.record_effect = recorded_then
    with pytest.raises(SoftTimeLimitExceeded if landing == "soft time limit" else LeaseLost), \
            effect(lease, "mail:1"):
        pytest.fail("the block ran")
    del store.effects.record_effect
    assert keys(store) == {} and events(store, "effect_unconfirmed") == []
    with effect(owners[0] if owners else lease, "mail:1") as first:
        assert first


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


def test_a_key_a_lost_answer_recorded_is_given_back_when_the_lease_ends_before_any_answer(store, hb):
    # The first try committed the key but its answer was lost, and no later try was answered before the
    # local deadline: the block never ran, so the key (this call's, by its nonce) must not stop the next
    # attempt from doing the effect.
    lease = claim(store, hb, "job-1", lease_duration=1.0)
    real, tries = store.effects.record_effect, []

    def unanswered(*args, **kwargs):
        tries.append(1)
        if len(tries) == 1:
            real(*args, **kwargs)
        raise StoreUnavailable("connection dropped before the answer")

    store.effects.record_effect = unanswered
    with pytest.raises(LeaseLost), effect(lease, "mail:1"):
        pytest.fail("the block ran without an answer")
    del store.effects.record_effect
    assert len(tries) > 1 and keys(store) == {}
    assert [e["detail"] for e in events(store, "effect_released")] == ['{"key": "mail:1"}']
    lapse(store, "job-1")
    with effect(claim(store, hb, "job-1"), "mail:1") as first:
        assert first


def test_a_key_a_lost_answer_recorded_is_given_back_when_the_next_try_finds_the_lease_moved_on(store, hb):
    lease = claim(store, hb, "job-1")
    real, owners = store.effects.record_effect, []

    def answer_lost_then_lease_moved_on(*args, **kwargs):
        outcome = real(*args, **kwargs)
        if not owners:
            lapse(store, "job-1")
            owners.append(claim(store, hb, "job-1"))
            raise StoreUnavailable("connection dropped before the answer")
        return outcome

    store.effects.record_effect = answer_lost_then_lease_moved_on
    with pytest.raises(LeaseLost), effect(lease, "mail:1"):
        pytest.fail("the block ran under a lease that moved on")
    del store.effects.record_effect
    assert keys(store) == {}
    with effect(owners[0], "mail:1") as first:
        assert first


def test_a_later_attempt_does_not_take_an_earlier_attempts_key_for_its_own(store, hb):
    first_owner = claim(store, hb, "job-1")
    with effect(first_owner, "mail:1") as first:
        assert first
    lapse(store, "job-1")
    second_owner = claim(store, hb, "job-1")
    with effect(second_owner, "mail:1") as first:
        assert not first


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
