"""The store's conformance suite: every role's transitions and the races between them, one module
run against SQLite, PostgreSQL and MariaDB (the `store` fixture), so a database family or a new
driver path that breaks a guarantee fails here by name.

Each race starts its contenders on a barrier and asserts exactly one winner and one audit event.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_lease.errors import StoreUnavailable
from celery_lease.store import COMPLETED, FAILED, PENDING, RUNNING, ClaimTerms, JobStatements, Store
from celery_lease.store.publishes import PublishStatements
from celery_lease.vocabulary import ClaimOutcome, EffectOutcome, Event
from tests.helpers import wait_for

TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=5, takeover=True)


@pytest.fixture
def store(store):
    """Owners count as gone at once and leases are taken back right after their grace."""
    store.hard_grace, store.stale_after = 0.0, 0.001
    store.clock_tolerance, store.claim_async_commit = 0.0, False
    return store


def claimed(store: Store, job_id: str, worker: str = "w1") -> str:
    """Record and claim ``job_id``; its token."""
    store.publishes.record(job_id, "t.task", "q", "{}", 5)
    tok = secrets.token_hex(16)
    assert store.jobs.claim(job_id, worker, tok, TERMS, "t.task", "q", lambda: None).claimed
    return tok


def expire(store: Store, job_id: str) -> None:
    """Move a lease past its expiry and grace on the store's clock (test-only SQL)."""
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lease_expires_at=store.now_sql - 10.0))


def race(*contenders: Callable[[], object]) -> list[object]:
    """Run the contenders at once; their results in order."""
    barrier, results = threading.Barrier(len(contenders)), [None] * len(contenders)

    def run(n: int) -> None:
        barrier.wait()
        results[n] = contenders[n]()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(contenders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def count(store: Store, job_id: str, event: Event) -> int:
    return len(store.reports.events(job_id, event))


# -- one job's life ------------------------------------------------------------------------
def test_a_job_goes_pending_running_completed_and_its_row_alone_records_the_claim_and_completion(store):
    tok = claimed(store, "life")

    assert store.jobs.complete("life", tok, "w1")

    job = store.get("life")
    assert (job.status, job.locked_by, job.attempt_count) == (COMPLETED, "w1", 1)
    assert job.started_at is not None and job.completed_at is not None
    assert job.started_at <= job.completed_at
    assert [e["event"] for e in store.reports.events("life")] == [Event.PUBLISHED]


def test_with_every_transition_audited_a_job_has_one_event_per_transition(store):
    store.audit_every_transition = True
    tok = claimed(store, "life")

    assert store.jobs.complete("life", tok, "w1")

    assert store.get("life").status == COMPLETED
    assert [e["event"] for e in store.reports.events("life")] == [Event.PUBLISHED, Event.CLAIMED,
                                                                  Event.COMPLETED]
    assert all(e["detail"] is None for e in store.reports.events("life")[1:])  # as before: no detail


def _previous(store: Store, job_id: str, event: Event) -> dict:
    """The previous attempt the job's one ``event`` recorded."""
    found = store.reports.events(job_id, event)
    assert len(found) == 1, found
    detail = json.loads(found[0]["detail"])
    return {k: detail[k] for k in ("previous_owner", "previous_token", "previous_started_at")}


def test_a_takeover_records_the_attempt_it_replaced(store):
    old = claimed(store, "tk", "w1")
    first = store.get("tk")
    expire(store, "tk")

    assert store.jobs.claim("tk", "w2", secrets.token_hex(16), TERMS, "t.task", "q", lambda: None).claimed

    assert _previous(store, "tk", Event.LEASE_TAKEN_OVER) == {
        "previous_owner": "w1", "previous_token": old[:8], "previous_started_at": first.started_at}
    assert (store.get("tk").locked_by, store.get("tk").attempt_count) == ("w2", 2)
    assert count(store, "tk", Event.CLAIMED) == 0


def test_a_reclaim_after_a_retry_is_audited_with_the_attempt_before(store):
    old = claimed(store, "rc", "w1")
    first = store.get("rc")
    assert store.jobs.retry_later("rc", old, 0.0, None, "flaky", "w1")

    new = secrets.token_hex(16)
    again = store.jobs.claim("rc", "w2", new, TERMS, "t.task", "q", lambda: None)

    assert again.claimed and (again.job.locked_by, again.job.attempt_count) == ("w2", 2)
    assert again.job.started_at >= first.started_at
    # The retry cleared the owner from the row: its own event names it; the start stays.
    assert _previous(store, "rc", Event.CLAIMED) == {
        "previous_owner": None, "previous_token": None, "previous_started_at": first.started_at}
    assert [e["event"] for e in store.reports.events("rc")] == [
        Event.PUBLISHED, Event.RETRY_SCHEDULED, Event.CLAIMED]


def test_a_reaper_requeue_and_dead_letter_record_the_attempt_they_took_back(store):
    old = claimed(store, "rq", "w1")
    first = store.get("rq")
    expire(store, "rq")
    assert store.reaping.requeue_abandoned("rq", old, "w1", delay=0.0, reason="expired")
    assert _previous(store, "rq", Event.REAPED_EXPIRED_LEASE) == {
        "previous_owner": "w1", "previous_token": old[:8], "previous_started_at": first.started_at}
    detail = json.loads(store.reports.events("rq", Event.REAPED_EXPIRED_LEASE)[0]["detail"])
    assert detail["delay"] == 0.0  # the detail it carried before stays

    again = store.jobs.claim("rq", "w2", secrets.token_hex(16), TERMS, "t.task", "q", lambda: None)
    assert again.claimed
    assert _previous(store, "rq", Event.CLAIMED)["previous_started_at"] == first.started_at
    expire(store, "rq")
    assert store.reaping.dead_letter_abandoned("rq", again.job.lock_token, "w2", error="gave up")
    assert _previous(store, "rq", Event.DEAD_LETTERED) == {
        "previous_owner": "w2", "previous_token": again.job.lock_token[:8],
        "previous_started_at": again.job.started_at}


def test_a_manual_requeue_records_the_attempt_it_took_back(store):
    old = claimed(store, "mr", "w1")
    first = store.get("mr")
    expire(store, "mr")

    assert store.recovery.manual_requeue(first, "ops@host")

    found = store.reports.events("mr", Event.MANUAL_REQUEUE)
    assert json.loads(found[0]["detail"]) == {
        "previous_status": RUNNING, "forced": False, "previous_owner": "w1", "previous_token": old[:8],
        "previous_started_at": first.started_at}
    assert (store.get("mr").status, store.get("mr").locked_by) == (PENDING, None)


def test_a_job_taken_over_twice_keeps_all_three_attempts_in_its_row_and_events(store):
    tokens, starts = [claimed(store, "three", "w1")], [store.get("three").started_at]
    for worker in ("w2", "w3"):
        expire(store, "three")
        tok = secrets.token_hex(16)
        assert store.jobs.claim("three", worker, tok, TERMS, "t.task", "q", lambda: None).claimed
        tokens.append(tok)
        starts.append(store.get("three").started_at)
    assert store.jobs.complete("three", tokens[-1], "w3")

    job = store.get("three")
    assert (job.locked_by, job.started_at, job.attempt_count) == ("w3", starts[-1], 3)
    takeovers = store.reports.events("three", Event.LEASE_TAKEN_OVER)
    assert [(e["worker"], json.loads(e["detail"])["previous_owner"]) for e in takeovers] == [
        ("w2", "w1"), ("w3", "w2")]
    assert [json.loads(e["detail"])["previous_started_at"] for e in takeovers] == starts[:2]
    assert [json.loads(e["detail"])["previous_token"] for e in takeovers] == [t[:8] for t in tokens[:2]]


@pytest.mark.parametrize(("write", "stale"), [
    (lambda s, t: s.jobs.complete("j", t, "w1"), Event.STALE_COMPLETION_REJECTED),
    (lambda s, t: s.jobs.fail("j", t, "boom", "w1"), Event.STALE_FAILURE_REJECTED),
    (lambda s, t: s.jobs.retry_later("j", t, 1.0, None, "again", "w1"), Event.STALE_RETRY_REJECTED),
    (lambda s, t: s.jobs.release("j", t, "w1"), Event.STALE_RELEASE_REJECTED),
    (lambda s, t: s.jobs.checkpoint("j", t, {"step": 2}, "w1"), Event.STALE_CHECKPOINT_REJECTED),
], ids=["complete", "fail", "retry", "release", "checkpoint"])
def test_every_owner_write_with_a_stale_token_changes_nothing_and_is_audited(store, write, stale):
    old = claimed(store, "j")
    expire(store, "j")
    new = secrets.token_hex(16)
    assert store.jobs.claim("j", "w2", new, TERMS, "t.task", "q", lambda: None).claimed
    before = store.get("j")

    assert write(store, old) is False

    after = store.get("j")
    assert (after.status, after.lock_token, after.checkpoint) == (RUNNING, new, before.checkpoint)
    assert count(store, "j", stale) == 1


# -- races -----------------------------------------------------------------------------------
@pytest.mark.parametrize("every_transition", [False, True], ids=["decisions", "every_transition"])
def test_claim_against_claim_has_one_winner(store, every_transition):
    store.audit_every_transition = every_transition
    store.publishes.record("cc", "t.task", "q", "{}", 5)
    outcomes = race(*(lambda n=n: store.jobs.claim("cc", f"w{n}", secrets.token_hex(16), TERMS, "t.task", "q",
                                                   lambda: None).outcome for n in range(6)))
    assert sorted(outcomes) == ["busy"] * 5 + ["claimed"]
    assert store.get("cc").attempt_count == 1  # one claim counted
    assert count(store, "cc", Event.CLAIMED) == (1 if every_transition else 0)


def test_reclaim_against_reclaim_has_one_winner_and_one_event(store):
    old = claimed(store, "rr", "w0")
    assert store.jobs.retry_later("rr", old, 0.0, None, "again", "w0")
    outcomes = race(*(lambda n=n: store.jobs.claim("rr", f"w{n}", secrets.token_hex(16), TERMS, "t.task", "q",
                                                   lambda: None).outcome for n in range(1, 5)))
    assert sorted(outcomes) == ["busy"] * 3 + ["claimed"]
    assert store.get("rr").attempt_count == 2
    assert count(store, "rr", Event.CLAIMED) == 1


def test_a_takeover_against_the_reaper_has_one_winner(store):
    old = claimed(store, "cr", "dead")
    expire(store, "cr")
    new = secrets.token_hex(16)

    took, requeued = race(
        lambda: store.jobs.claim("cr", "w2", new, TERMS, "t.task", "q", lambda: None).claimed,
        lambda: store.reaping.requeue_abandoned("cr", old, "dead", delay=0.0, reason="lease expired"))

    job = store.get("cr")
    assert [took, requeued].count(True) >= 1
    if took and not requeued:
        assert (job.status, job.lock_token) == (RUNNING, new)
        assert count(store, "cr", Event.REAPED_EXPIRED_LEASE) == 0
    elif requeued and not took:
        assert (job.status, job.lock_token) == (PENDING, None)
        assert count(store, "cr", Event.LEASE_TAKEN_OVER) == 0
    else:  # the reaper requeued first, then the claim took the pending job: still one owner
        assert (job.status, job.lock_token) == (RUNNING, new)
    assert job.expired_count == 1  # one expiration counted, whoever won


def test_two_reapers_take_one_lease_back_once(store):
    old = claimed(store, "rr", "dead")
    expire(store, "rr")

    results = race(*(lambda: store.reaping.requeue_abandoned("rr", old, "dead", delay=0.0,
                                                             reason="expired"),) * 4)

    assert results.count(True) == 1
    assert count(store, "rr", Event.REAPED_EXPIRED_LEASE) == 1


def test_the_reaper_clock_record_round_trips_and_a_step_back_clamps_only_what_lies_in_the_future(store):
    assert store.reaping.reaper_clock() is None
    claimed(store, "fresh")
    claimed(store, "old-clock")
    j, w = store.t.jobs, store.t.workers
    store.workers.touch_worker("w-old", "host", 1)
    with store.begin() as c:  # written on a clock 60 s ahead of the store's
        c.execute(sa.update(j).where(j.c.id == "old-clock").values(lease_expires_at=store.now_sql + 90))
        c.execute(sa.update(w).where(w.c.worker_id == "w-old").values(last_seen_at=store.now_sql + 60))
    fresh = store.get("fresh").lease_expires_at
    state = {"at": store.now(), "calm_since": None}
    store.reaping.record_reaper_clock(state, held_back="stepped back", owner="r", step_back=True)
    now = store.now()
    assert store.reaping.reaper_clock() == state
    assert store.get("fresh").lease_expires_at == fresh
    assert now - 1.0 < store.get("old-clock").lease_expires_at - 30.0 <= now
    with store.begin() as c:
        seen = c.execute(sa.select(w.c.last_seen_at).where(w.c.worker_id == "w-old")).scalar_one()
    assert seen <= now
    [event] = store.reports.events(None, Event.REAPER_HELD_BACK)
    assert event["reason"] == "stepped back"


def test_a_dead_letter_against_a_late_completion_has_one_outcome(store):
    tok = claimed(store, "dc", "dead")
    expire(store, "dc")

    completed, dead = race(lambda: store.jobs.complete("dc", tok, "dead"),
                           lambda: store.reaping.dead_letter_abandoned("dc", tok, "dead", error="expired"))

    assert [completed, dead].count(True) == 1
    assert store.get("dc").status == (COMPLETED if completed else FAILED)


# -- effects and locks ---------------------------------------------------------------------------
def test_an_effect_key_is_first_once_duplicate_after_and_lost_to_a_stale_owner(store):
    tok = claimed(store, "fx")
    racers = race(*(lambda: store.effects.record_effect("pay:1", "fx", tok, "w1"),) * 4)
    assert sorted(racers) == [EffectOutcome.DUPLICATE] * 3 + [EffectOutcome.FIRST]

    expire(store, "fx")
    assert store.jobs.claim("fx", "w2", secrets.token_hex(16), TERMS, "t.task", "q", lambda: None).claimed

    assert store.effects.record_effect("pay:2", "fx", tok, "w1") == EffectOutcome.LOST
    assert store.reports.effect_keys("fx") == ["pay:1"]
    assert count(store, "fx", Event.STALE_EFFECT_REJECTED) == 1


def test_a_resource_lock_has_one_holder_is_taken_after_expiry_and_refused_to_a_stale_lease(store):
    tok = claimed(store, "lk")
    holders = race(*(lambda n=n: store.effects.acquire_lock("acct:7", f"lt{n}", 30.0, "w1", "lk", tok)
                     for n in range(4)))
    assert sorted(holders) == [EffectOutcome.DUPLICATE] * 3 + [EffectOutcome.FIRST]

    k = store.t.locks
    with store.begin() as c:
        c.execute(sa.update(k).where(k.c.resource == "acct:7").values(expires_at=store.now_sql - 1.0))
    assert store.effects.acquire_lock("acct:7", "late", 30.0, "w1", "lk", tok) == EffectOutcome.FIRST
    assert count(store, "lk", Event.LOCK_TAKEN_AFTER_EXPIRY) == 1

    expire(store, "lk")
    assert store.jobs.claim("lk", "w2", secrets.token_hex(16), TERMS, "t.task", "q", lambda: None).claimed
    assert store.effects.acquire_lock("acct:8", "stale", 30.0, "w1", "lk", tok) == EffectOutcome.LOST
    assert store.reports.lock_holder("acct:8") is None


# -- what Celery carries ----------------------------------------------------------------------
TEN_MB = 10 * 1024 * 1024


def test_ten_megabyte_arguments_results_and_checkpoints_round_trip(store):
    """Plain Celery sends a message of any size its broker takes: the store keeps it whole."""
    from celery_lease.messaging import messages

    big = "".join(secrets.choice("abcdefghij") for _ in range(1024)) * (TEN_MB // 1024)
    payload = messages.encode("t.task", (big,), {"note": "ü€"}, {}, "json")
    assert len(payload) > TEN_MB
    # A message recorded by its publisher, and one first seen by a worker (the claim writes it).
    store.publishes.record("published", "t.task", "q", payload, 5)
    tok = secrets.token_hex(16)
    assert store.jobs.claim("published", "w1", tok, TERMS, "t.task", "q", lambda: None).claimed
    seen = secrets.token_hex(16)
    assert store.jobs.claim("first-seen", "w1", seen, TERMS, "t.task", "q", lambda: payload).claimed
    assert store.jobs.checkpoint("published", tok, {"rows": big})
    result = messages.encode_result([big, "ü€"], "json")
    assert store.jobs.complete("published", tok, "w1", result)

    job, first = store.get("published"), store.get("first-seen")
    kept = {"payload": job.payload, "first-seen payload": first.payload,
            "checkpoint": job.checkpoint, "result": store.jobs.kept_result("published")}
    want = {"payload": payload, "first-seen payload": payload,
            "checkpoint": json.dumps({"rows": big}), "result": result}
    assert job.status == COMPLETED
    assert {k: _digest(v) for k, v in kept.items()} == {k: _digest(v) for k, v in want.items()}


def _digest(text: str | None) -> tuple[int, str] | None:
    """A long text's length and hash: what a failed comparison can print."""
    return None if text is None else (len(text), hashlib.sha256(text.encode()).hexdigest()[:16])


# -- completions sharing one commit (lease_group_commit) ------------------------------------------
@pytest.fixture
def grouped(store):
    """A second store on the same tables, with lease_group_commit (MySQL/MariaDB: each alone)."""
    other = Store(store.url, store.prefix, group_commit=True)
    yield other
    other.engine.dispose()


def behind_a_held_write(group: Any, held_id: str, id_of: Callable[[Any], str], held: Callable[[], object],
                        calls: list[Callable[[], object]], queued: int) -> tuple[object, list[object]]:
    """Run ``held``, a lone write that ``group`` (None: the store does not group) holds in its commit,
    then ``calls`` at once, released once ``queued`` of them wait: where the store groups them, they
    share the next commit. The held call's answer, and each call's answer or error."""
    gate, entered = threading.Event(), threading.Event()
    if group is not None:
        write = group._write

        def hold(batch: list) -> list:
            if id_of(batch[0]) == held_id:
                entered.set()
                assert gate.wait(30)
            return write(batch)

        group._write = hold
    results: list[object] = [None] * (len(calls) + 1)

    def run(n: int, call: Callable[[], object]) -> None:
        try:
            results[n] = call()
        except Exception as exc:  # noqa: BLE001 - the test compares what each caller got
            results[n] = exc

    first = threading.Thread(target=run, args=(0, held))
    first.start()
    if group is not None:
        assert entered.wait(30)
    threads = [threading.Thread(target=run, args=(n + 1, call)) for n, call in enumerate(calls)]
    for t in threads:
        t.start()
    if group is not None:
        wait_for(lambda: len(group._queue) == queued, timeout=30, message="the writes never queued")
    gate.set()
    for t in [first, *threads]:
        t.join(30)
    return results[0], results[1:]


def shared_commit(g: Store, completions: list[tuple[str, str, str | None]]) -> list[object]:
    """Complete ``completions`` (job, token, kept result) at once, queued behind a held lone completion
    so that, where the store groups them, they share the next commit: each caller's answer or error."""
    held_job = f"held-{secrets.token_hex(4)}"
    lone = claimed(g, held_job)
    held, answers = behind_a_held_write(
        getattr(g.jobs, "group", None), held_job, lambda c: c.job_id,
        lambda: g.jobs.complete(held_job, lone, "w1", None),
        [functools.partial(g.jobs.complete, job, tok, "w1", result) for job, tok, result in completions],
        len(completions))
    assert held is True
    return answers


def counted(g: Store, marker: str) -> list[str]:
    """The statements SQLAlchemy sends from now on with a parameter holding ``marker`` (the batch's,
    and each completion's where the store writes them alone)."""
    seen: list[str] = []

    @sa.event.listens_for(g.engine, "before_cursor_execute")
    def count(conn, cursor, statement, parameters, context, executemany) -> None:
        if marker in str(parameters):
            seen.append(statement.split()[0].upper())

    return seen


def test_completions_due_at_once_share_one_statement_each_row_fenced_and_written_as_alone(store, grouped):
    toks = {f"grp-{n}": claimed(grouped, f"grp-{n}") for n in range(5)}
    kept = {"grp-1": '"one"', "grp-3": '{"three": 3}'}
    seen = counted(grouped, "grp-")
    answers = shared_commit(grouped, [(job, tok, kept.get(job)) for job, tok in toks.items()])
    assert answers == [True] * 5
    if store.dialect.group_commit:
        assert seen == ["UPDATE"]  # five completions, one statement
        assert grouped.jobs.group.batches == 2  # the held lone completion, then the five
    else:
        # No UPDATE ... RETURNING: each completion alone, as today (its UPDATE, then its row read).
        assert seen.count("UPDATE") == 5 and type(grouped.jobs) is JobStatements
    for job in toks:
        row = store.get(job)
        assert (row.status, row.lock_token, row.lease_expires_at) == (COMPLETED, None, None)
        assert row.completed_at is not None and row.completed_at >= row.started_at
        assert store.jobs.kept_result(job) == kept.get(job)
        assert [e["event"] for e in store.reports.events(job)] == [Event.PUBLISHED]


def test_a_token_rejected_inside_a_batch_rejects_that_job_alone_audited_the_others_complete(store, grouped):
    toks = {f"r{n}": claimed(grouped, f"r{n}") for n in range(4)}
    j = store.t.jobs
    with store.begin() as c:  # r1's lease moved on; r2's row vanished (test-only SQL)
        c.execute(sa.update(j).where(j.c.id == "r1").values(lock_token="thief", locked_by="w2"))
        c.execute(sa.delete(j).where(j.c.id == "r2"))
    answers = shared_commit(grouped, [(job, tok, '"kept"') for job, tok in toks.items()])
    assert answers == [True, False, False, True]
    assert [store.get(job).status for job in ("r0", "r3")] == [COMPLETED, COMPLETED]
    assert (store.get("r1").status, store.get("r1").lock_token) == (RUNNING, "thief")
    assert store.get("r2") is None
    assert store.jobs.kept_result("r1") is None
    for job in toks:
        assert count(store, job, Event.STALE_COMPLETION_REJECTED) == (job in ("r1", "r2"))


# -- first claims sharing one commit (lease_group_commit) -------------------------------------------
def shared_claims(g: Store, claims: list[tuple[str, str]]) -> list[object]:
    """Claim ``claims`` (job, token) at once, queued behind a held lone claim so that, where the store
    groups them, they share the next commit: each caller's Claim or error."""
    held_job = f"held-{secrets.token_hex(4)}"
    g.publishes.record(held_job, "t.task", "q", "{}", 5)
    held, answers = behind_a_held_write(
        getattr(g.jobs, "claims", None), held_job, lambda c: c.job_id,
        lambda: g.jobs.claim(held_job, "w1", secrets.token_hex(16), TERMS, "t.task", "q", lambda: None),
        [functools.partial(g.jobs.claim, job, "w1", tok, TERMS, "t.task", "q", lambda: '{"p": 1}')
         for job, tok in claims], len(claims))
    assert held.claimed  # type: ignore[attr-defined]
    return answers


def sqlite_trace(g: Store) -> list[str]:
    """Every statement SQLite's driver runs for ``g`` from now on (empty on the other databases)."""
    statements: list[str] = []
    if g.dialect.name == "sqlite":
        @sa.event.listens_for(g.engine, "connect")
        def trace(dbapi_conn, _record) -> None:
            dbapi_conn.set_trace_callback(statements.append)

        g.engine.dispose()  # connections opened from now on are traced
    return statements


def assert_batch_shared_one_commit(store: Store, trace: list[str], prefix: str, verb: str,
                                   events: bool = False) -> None:
    """The jobs whose ids begin ``prefix`` (``events``: and their events) were last written by one
    transaction.

    PostgreSQL: rows one transaction wrote carry its id (``xmin``). SQLite: the driver's trace holds two
    transactions running ``verb`` (the store's first reads of its schema aside): the held lone write's,
    then the batch's."""
    if store.dialect.name == "postgresql":
        j, e = store.t.jobs.name, store.t.events.name
        with store.begin(read=True) as c:
            union = f" UNION SELECT xmin::text FROM {e} WHERE job_id LIKE :p" if events else ""
            xids = c.execute(sa.text(f"SELECT DISTINCT xmin::text FROM {j} WHERE id LIKE :p{union}"),
                             {"p": f"{prefix}%"}).scalars().all()
        assert len(xids) == 1
    else:
        words = " ".join(sql.split()[0] for sql in trace)
        assert sum(verb in transaction for transaction in words.split("COMMIT")) == 2


def as_claimed(store: Store, job_id: str) -> tuple[dict[str, object], list[str]]:
    """What a claim wrote of ``job_id``, its id, token and clock readings aside: the row and its events."""
    job = store.get(job_id)
    row = {k: v for k, v in vars(job).items() if k not in (
        "id", "lock_token", "created_at", "updated_at", "available_at", "started_at", "last_heartbeat_at",
        "lease_expires_at")}
    row["lease"] = round(job.lease_expires_at - job.started_at, 3)
    return row, [e["event"] for e in store.reports.events(job_id)]


def test_first_claims_due_at_once_share_one_commit_and_write_what_a_claim_alone_writes(store, grouped):
    store.publishes.record("alone", "t.task", "q", "{}", 5)
    assert store.jobs.claim("alone", "w1", secrets.token_hex(16), TERMS, "t.task", "q", lambda: None).claimed
    toks = {f"clm-{n}": secrets.token_hex(16) for n in range(5)}
    for job in toks:
        store.publishes.record(job, "t.task", "q", "{}", 5)
    updates = sqlite_trace(grouped)

    answers = shared_claims(grouped, list(toks.items()))

    assert [(a.outcome, a.job.lock_token) for a in answers] == [  # type: ignore[attr-defined]
        (ClaimOutcome.CLAIMED, tok) for tok in toks.values()]
    for job, tok in toks.items():
        assert store.get(job).lock_token == tok
        assert as_claimed(store, job) == as_claimed(store, "alone")
    if not store.dialect.group_commit:
        assert type(grouped.jobs) is JobStatements  # MySQL/MariaDB: each claim alone
        return
    assert grouped.jobs.claims.batches == 2  # the held lone claim, then the five
    assert_batch_shared_one_commit(store, updates, "clm-", "UPDATE")


def test_a_batch_of_claims_answers_every_claim_it_cannot_take_as_that_claim_alone_would(store, grouped):
    claimed(store, "busy", worker="w2")
    store.jobs.complete("done", claimed(store, "done"), "w1")
    claimed(store, "abandoned", worker="w2")
    expire(store, "abandoned")
    for job in ("fresh", "twice"):
        store.publishes.record(job, "t.task", "q", "{}", 5)
    store.publishes.record("later", "t.task", "q", "{}", 5, delay=600.0)
    claims = [("busy", "t-busy"), ("done", "t-done"), ("unknown", "t-unknown"), ("abandoned", "t-aband"),
              ("fresh", "t-fresh"), ("twice", "t-twice-1"), ("twice", "t-twice-2"), ("later", "t-later")]

    answers = shared_claims(grouped, claims)

    outcomes = [a.outcome for a in answers]  # type: ignore[attr-defined]
    assert outcomes[:5] + outcomes[7:] == [ClaimOutcome.BUSY, ClaimOutcome.DONE, ClaimOutcome.CLAIMED,
                                           ClaimOutcome.CLAIMED, ClaimOutcome.CLAIMED, ClaimOutcome.EARLY]
    # The job claimed twice at once: one claim takes it, the other finds it taken.
    assert sorted(outcomes[5:7]) == sorted([ClaimOutcome.CLAIMED, ClaimOutcome.BUSY])
    winner = claims[5 + outcomes[5:7].index(ClaimOutcome.CLAIMED)][1]
    tokens = {job: store.get(job).lock_token for job in ("busy", "unknown", "abandoned", "fresh", "twice")}
    assert tokens["busy"] != "t-busy" and tokens["unknown"] == "t-unknown"
    assert (tokens["abandoned"], tokens["fresh"], tokens["twice"]) == ("t-aband", "t-fresh", winner)
    assert count(store, "abandoned", Event.LEASE_TAKEN_OVER) == 1
    assert store.get("unknown").payload == '{"p": 1}' and count(store, "unknown", Event.CLAIMED) == 1
    assert (store.get("later").status, store.get("done").status) == (PENDING, COMPLETED)
    assert store.get("twice").attempt_count == 1


def test_with_every_transition_audited_each_claim_of_a_batch_is_written_alone_with_its_event(store, grouped):
    grouped.audit_every_transition = True
    toks = {f"ca{n}": secrets.token_hex(16) for n in range(3)}
    for job in toks:
        store.publishes.record(job, "t.task", "q", "{}", 5)
    assert all(a.claimed for a in shared_claims(grouped, list(toks.items())))  # type: ignore[attr-defined]
    for job, tok in toks.items():
        events = store.reports.events(job)
        assert [e["event"] for e in events] == [Event.PUBLISHED, Event.CLAIMED]
        assert (events[-1]["worker"], events[-1]["token"]) == ("w1", tok[:8])


@contextlib.contextmanager
def first_batch_commit_fails(store: Store, grouped: Store) -> Iterator[None]:
    """The first commit that completes a job named ``fail-*`` fails; later ones commit.

    PostgreSQL: a deferred constraint trigger (test-only SQL) raises a serialization failure at
    the commit of the batch's own transaction. SQLite: the batch's transaction raises after its
    UPDATE, before its commit, and is rolled back.
    """
    if store.dialect.name != "postgresql":
        real_begin = grouped.begin

        @contextlib.contextmanager
        def failing_begin(**kwargs):
            with real_begin(**kwargs) as c:
                yield c
                grouped.begin = real_begin  # once: the next batch commits
                raise StoreUnavailable("commit lost")

        grouped.begin = failing_begin
        try:
            yield
        finally:
            grouped.begin = real_begin
        return
    probe, jobs = f"{store.prefix}fail", store.t.jobs.name
    with store.begin() as c:
        c.execute(sa.text(f"CREATE SEQUENCE {probe}_seq"))
        c.execute(sa.text(
            f"CREATE FUNCTION {probe}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF nextval('{probe}_seq') = 1 THEN "
            f"RAISE EXCEPTION 'commit refused' USING ERRCODE = '40001'; END IF; RETURN NULL; END $$"))
        c.execute(sa.text(
            f"CREATE CONSTRAINT TRIGGER {probe} AFTER UPDATE ON {jobs} DEFERRABLE INITIALLY DEFERRED "
            f"FOR EACH ROW WHEN (NEW.id LIKE 'fail-%' AND NEW.status = 'completed') "
            f"EXECUTE FUNCTION {probe}()"))
    try:
        yield
    finally:
        with store.begin() as c:
            c.execute(sa.text(f"DROP FUNCTION {probe}() CASCADE"))
            c.execute(sa.text(f"DROP SEQUENCE {probe}_seq"))


def test_a_batch_whose_commit_fails_raises_in_every_caller_and_completes_none_of_its_rows(store, grouped):
    if not store.dialect.group_commit:
        pytest.skip("MySQL/MariaDB write each completion alone")
    toks = {f"fail-{n}": claimed(grouped, f"fail-{n}") for n in range(3)}
    with first_batch_commit_fails(store, grouped):
        answers = shared_commit(grouped, [(job, tok, None) for job, tok in toks.items()])
        assert isinstance(answers[0], StoreUnavailable)
        assert all(a is answers[0] for a in answers)  # the batch's error, raised in each caller
        assert [store.get(job).status for job in toks] == [RUNNING] * 3
        assert all(count(store, job, Event.STALE_COMPLETION_REJECTED) == 0 for job in toks)
        # The next batch runs, and its callers' writes (the same ones, retried) complete.
        assert shared_commit(grouped, [(job, tok, None) for job, tok in toks.items()]) == [True] * 3
    assert [store.get(job).status for job in toks] == [COMPLETED] * 3


def test_with_every_transition_audited_a_batch_writes_each_jobs_completed_event(store, grouped):
    grouped.audit_every_transition = True
    toks = {f"a{n}": claimed(grouped, f"a{n}") for n in range(3)}
    assert shared_commit(grouped, [(job, tok, None) for job, tok in toks.items()]) == [True] * 3
    for job, tok in toks.items():
        events = store.reports.events(job)
        assert [e["event"] for e in events] == [Event.PUBLISHED, Event.CLAIMED, Event.COMPLETED]
        assert (events[-1]["worker"], events[-1]["token"], events[-1]["detail"]) == ("w1", tok[:8], None)


# -- publish records sharing one commit (lease_group_commit) ---------------------------------------
RECOVERY = {"on_expired": "requeue", "max_expirations": 3, "backoff_base": 0.5, "backoff_jitter": True,
            "dispatch_timeout": 9.5}


def publish(job_id: str, **options: object) -> dict[str, object]:
    """publishes.record()'s arguments for ``job_id``: a delayed job with a recovery policy."""
    return {"job_id": job_id, "task_name": "t.task", "queue": "q", "payload": '{"p": 1}', "max_attempts": 5,
            "delay": 7.0, "recovery": RECOVERY, **options}


def shared_records(g: Store, records: list[dict[str, object]]) -> list[object]:
    """Record ``records`` (publishes.record's arguments) at once, queued behind a held lone record so
    that, where the store groups them, those without a key share the next commit: each caller's answer
    or error."""
    held_job = f"held-{secrets.token_hex(4)}"
    held, answers = behind_a_held_write(
        getattr(g.publishes, "group", None), held_job, lambda r: r.job.id,
        lambda: g.publishes.record(**publish(held_job)),  # type: ignore[arg-type]
        [functools.partial(g.publishes.record, **r) for r in records],  # type: ignore[arg-type]
        sum(1 for r in records if r.get("idempotency_key") is None))
    assert held == (True, held_job)
    return answers


def as_recorded(store: Store, job_id: str) -> tuple[dict[str, object], list[tuple[object, ...]]]:
    """What a record wrote of ``job_id``, its id and clock readings aside: the row and its events."""
    row = {k: v for k, v in vars(store.get(job_id)).items() if k not in ("id", "created_at", "updated_at")}
    row["available_at"] = round(row["available_at"] - store.get(job_id).created_at, 3)
    events = [(e["event"], e["reason"], e["worker"], e["token"], e["detail"], e.get("queue_name"),
               e.get("task_name")) for e in store.reports.events(job_id)]
    return row, events


def test_publish_records_due_at_once_share_one_commit_and_write_what_each_writes_alone(store, grouped):
    assert store.publishes.record(**publish("alone")) == (True, "alone")
    jobs = [f"pub-{n}" for n in range(5)]
    commits = sqlite_trace(grouped)

    assert shared_records(grouped, [publish(job) for job in jobs]) == [(True, job) for job in jobs]

    for job in jobs:
        assert as_recorded(store, job) == as_recorded(store, "alone")
    if not store.dialect.group_commit:
        assert type(grouped.publishes) is PublishStatements  # MySQL/MariaDB: each record alone
        return
    assert grouped.publishes.group.batches == 2  # the held lone record, then the five
    assert_batch_shared_one_commit(store, commits, "pub-", "INSERT", events=True)


def test_a_known_id_in_a_batch_is_answered_as_alone_and_the_batch_records_every_other(store, grouped):
    claimed(store, "done")
    store.jobs.complete("done", store.get("done").lock_token, "w1")
    store.publishes.record("taken", "t.task", "q", "{}", 5)
    store.publishes.record("holder", "t.task", "q", "{}", 5, idempotency_key="key-1")

    answers = shared_records(grouped, [
        publish("new-0"), publish("done", reopen=True), publish("taken"), publish("new-1"),
        publish("keyed", idempotency_key="key-1")])

    assert answers == [(True, "new-0"), (False, "done"), (False, "taken"), (True, "new-1"), (False, "holder")]
    assert [count(store, job, Event.PUBLISHED) for job in ("new-0", "new-1")] == [1, 1]
    assert (store.get("done").status, count(store, "done", Event.REPUBLISHED)) == (PENDING, 1)
    assert store.get("taken").payload == "{}" and store.get("keyed") is None
    if store.dialect.group_commit:
        # The held record, then the batch the known ids rolled back (each record was then written alone).
        assert grouped.publishes.group.batches == 2
