"""The helper threads (celery_lease/worker/threads.py): the loop's one shape (started once, woken early,
stopped and joined, outliving a bad round), and the heartbeat's renewal round (one statement per round, loss
detection, max runtime, late confirmations)."""

from __future__ import annotations

import logging
import secrets
import sys
import threading
import time

import pytest
import sqlalchemy as sa

from celery_lease import deadline
from celery_lease.config import load
from celery_lease.errors import LeaseLost, StoreUnavailable
from celery_lease.store import ClaimTerms
from celery_lease.vocabulary import Event, RunEnd
from celery_lease.worker.lease import DeferredWrite, Lease
from celery_lease.worker.runtime import Runtime
from celery_lease.worker.threads import Loop
from tests.helpers import wait_for


class Rounds:
    """A step that counts its rounds and returns what the test sets (seconds, or None: until a wake)."""

    def __init__(self, pause: float | None = 60.0) -> None:
        self.pause = pause
        self.count = 0
        self.raise_next = False
        self.failures: list[BaseException | None] = []

    def step(self) -> float | None:
        self.count += 1
        if self.raise_next:
            self.raise_next = False
            raise ValueError("bad round")
        return self.pause

    def failed(self) -> float | None:
        self.failures.append(sys.exc_info()[1])  # called inside the except: the traceback is there to log
        return 0.0


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_many_threads_starting_a_loop_at_once_start_one_thread() -> None:
    rounds = Rounds()
    loop = Loop("test-loop-once", rounds.step, rounds.failed)
    barrier = threading.Barrier(16)

    def first() -> None:
        barrier.wait()
        loop.start()

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # widen every race
    try:
        callers = [threading.Thread(target=first) for _ in range(16)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(10)
    finally:
        sys.setswitchinterval(previous)
    try:
        wait_for(lambda: rounds.count >= 1, timeout=5, message="the loop never ran")
        assert len(named("test-loop-once")) == 1
        assert rounds.count == 1  # one thread, one first round, then a 60 s pause
    finally:
        loop.stop()


def test_a_wake_runs_the_next_round_before_its_pause_ends() -> None:
    rounds = Rounds(pause=60.0)
    loop = Loop("test-loop-wake", rounds.step, rounds.failed)
    loop.start()
    try:
        wait_for(lambda: rounds.count == 1, timeout=5, message="no first round")
        loop.wake()
        wait_for(lambda: rounds.count == 2, timeout=5, message="the wake did not bring the round forward")
    finally:
        loop.stop()


def test_a_step_returning_none_waits_for_a_wake_and_a_delay_holds_the_first_round_back() -> None:
    rounds = Rounds(pause=None)
    loop = Loop("test-loop-none", rounds.step, rounds.failed)
    loop.start(delay=60.0)
    try:
        wait_for(lambda: loop.woken is not None and loop.thread is not None and loop.thread.is_alive(),
                 timeout=5, message="the thread did not start")
        assert rounds.count == 0  # 60 s to go
        loop.wake()
        wait_for(lambda: rounds.count == 1, timeout=5, message="the wake did not run the first round")
        loop.wake()
        wait_for(lambda: rounds.count == 2, timeout=5, message="None did not wait for the next wake")
    finally:
        loop.stop()


def test_stop_wakes_the_thread_and_joins_it() -> None:
    rounds = Rounds(pause=60.0)
    loop = Loop("test-loop-stop", rounds.step, rounds.failed)
    loop.start()
    wait_for(lambda: rounds.count == 1, timeout=5, message="no first round")
    loop.stop(timeout=5.0)
    assert loop.thread is not None and not loop.thread.is_alive()  # joined, not 60 s later
    assert rounds.count == 1 and not loop.running()


def test_a_step_that_raises_is_handed_to_failed_and_the_loop_goes_on() -> None:
    rounds = Rounds(pause=60.0)
    rounds.raise_next = True
    loop = Loop("test-loop-raise", rounds.step, rounds.failed)
    loop.start()
    try:
        # The raising round's failed() returns 0: the next round follows at once.
        wait_for(lambda: rounds.count == 2, timeout=5, message="the loop did not outlive the bad round")
        [error] = rounds.failures
        assert isinstance(error, ValueError) and str(error) == "bad round"
        assert loop.running()
    finally:
        loop.stop()


def test_a_step_that_stops_its_own_loop_ends_it_and_a_start_meanwhile_runs_a_new_thread() -> None:
    """What kept cancels and the store probe rely on: a step ends its loop under its owner's lock, and
    a start that comes while that thread winds down must not count it as running."""
    rounds = Rounds(pause=60.0)
    winding_down = threading.Event()
    loop: Loop

    def last_round() -> float | None:
        pause = rounds.step()
        loop.stop()  # from the loop's own thread: no join of itself
        if rounds.count == 1:
            winding_down.wait(10)  # the first thread is still alive when the second start comes
        return pause

    loop = Loop("test-loop-self-stop", last_round, rounds.failed)
    loop.start()
    first = loop.thread
    assert first is not None
    try:
        wait_for(lambda: rounds.count == 1, timeout=5, message="no first round")
        assert first.is_alive()
        loop.start()
        wait_for(lambda: rounds.count == 2, timeout=5, message="a thread winding down blocked the new start")
        assert loop.thread is not first
    finally:
        winding_down.set()
    first.join(5)
    assert loop.thread is not None
    loop.thread.join(5)
    assert not first.is_alive() and not loop.thread.is_alive() and rounds.failures == []

def policy(**overrides):
    return load({}).policy({"lease_duration": 3.0, "lease_heartbeat_interval": 0.2, **overrides})


class Request:
    """Stands for a Celery request context: the runtime keys a body's lease by it."""


def held_lease(store, rt: Runtime, job_id: str, **overrides) -> Lease:
    store.publishes.record(job_id, "t.task", "q", "{}", 3)
    tok = secrets.token_hex(16)
    sent = deadline.monotonic()
    got = store.jobs.claim(job_id, rt.worker, tok,
                           ClaimTerms(duration=3.0, grace=0.0, max_attempts=3, max_expirations=3,
                                      takeover=True),
                           task_name="t.task", queue="q", payload=lambda: None)
    assert got.claimed
    lease = Lease(rt, job_id, tok, 1, policy(**overrides), f"t.task:{job_id}", None, sent_at=sent)
    rt.attach(Request(), lease)
    return lease


def steal(store, job_id: str) -> None:
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lock_token="thief", locked_by="other:1"))


@pytest.fixture
def rt(store):
    runtime = Runtime(store, "host", default_interval=0.2, worker="host:1")
    # The rounds of these tests are driven by hand: no threads.
    runtime.start = lambda: None
    yield runtime
    runtime.stop()


@pytest.fixture
def hb(rt):
    return rt.heartbeat


def test_one_statement_renews_every_lease_of_the_process(store, hb):
    leases = [held_lease(store, hb.runtime, f"job-{n}") for n in range(40)]
    before = {lease.job_id: store.get(lease.job_id).lease_expires_at for lease in leases}
    hb.beat()  # the first round registers the process
    statements: list[str] = []

    def collect(_conn, _cursor, statement, *_args):
        statements.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", collect)
    try:
        counts = hb.beat()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", collect)
    assert counts["renewed"] == 40 and counts["lost"] == 0
    assert len([s for s in statements if f"UPDATE {store.t.jobs.name} " in s]) == 1
    if store.dialect.name == "postgresql":
        assert len(statements) == 1  # the registry refresh rides in the same statement
    assert all(store.get(job_id).lease_expires_at > expiry for job_id, expiry in before.items())


def test_a_lease_taken_by_another_owner_is_marked_lost(store, hb):
    lease = held_lease(store, hb.runtime, "stolen")
    steal(store, "stolen")
    counts = hb.beat()
    assert counts["lost"] == 1 and lease.lost and lease.lost_reason == "taken_over"
    with pytest.raises(LeaseLost, match="other:1"):
        lease.check()
    assert "lease_lost" in [e["event"] for e in store.reports.events("stolen")]


def test_a_vanished_lease_is_told_apart_from_a_taken_one(store, hb):
    lease = held_lease(store, hb.runtime, "vanishing")
    with store.begin() as c:
        c.execute(sa.delete(store.t.jobs).where(store.t.jobs.c.id == "vanishing"))
    hb.beat()
    assert lease.lost and lease.lost_reason == "vanished"


def test_lost_lease_interrupts_the_running_body(store, hb):
    lease = held_lease(store, hb.runtime, "interrupted", lease_on_lost="raise")
    caught: list[BaseException] = []
    entered = threading.Event()

    def body() -> None:
        try:
            with lease.body():
                entered.set()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    sum(range(1000))  # pure Python work, interruptible between bytecodes
        except LeaseLost as exc:
            caught.append(exc)

    worker = threading.Thread(target=body)
    worker.start()
    entered.wait(5)
    steal(store, "interrupted")
    hb.beat()
    worker.join(10)
    assert caught and isinstance(caught[0], LeaseLost) and "interrupted" in str(caught[0])


def test_a_body_whose_lease_was_lost_before_it_began_never_runs(store, hb):
    # Lost between the claim and the body (the backend slow to store STARTED, a pause): no interruption is
    # sent for a body not yet running, and the job may be another worker's by now.
    stolen = held_lease(store, hb.runtime, "lost-before", lease_on_lost="raise")
    steal(store, "lost-before")
    hb.beat()
    lapsed = held_lease(store, hb.runtime, "lapsed-before", lease_on_lost="raise")
    lapsed.deadline = deadline.monotonic() - 0.01  # its local deadline passed before the body began
    ran: list[str] = []
    for lease in (stolen, lapsed):
        with pytest.raises(LeaseLost), lease.body():
            ran.append(lease.job_id)
    assert ran == [] and stolen.lost and lapsed.lost


def test_flag_mode_leaves_the_body_running(store, hb):
    lease = held_lease(store, hb.runtime, "flagged", lease_on_lost="flag")
    finished = threading.Event()

    def body() -> None:
        with lease.body():
            wait_for(lambda: lease.lost, timeout=5, message="lease never flagged lost")
            finished.set()

    worker = threading.Thread(target=body)
    worker.start()
    steal(store, "flagged")
    hb.beat()
    worker.join(10)
    assert finished.is_set()


def test_a_job_past_its_max_runtime_is_no_longer_renewed(store, hb, monkeypatch):
    lease = held_lease(store, hb.runtime, "hung", lease_max_runtime=5.0)
    expiry = store.get("hung").lease_expires_at
    monkeypatch.setattr(deadline, "monotonic", lambda: lease.started_at + 6.0)
    counts = hb.beat()
    assert counts["past_max_runtime"] == 1 and counts["renewed"] == 0
    assert store.get("hung").lease_expires_at == expiry


def test_a_store_outage_marks_nothing_lost_and_moves_no_deadline(store, hb, monkeypatch):
    lease = held_lease(store, hb.runtime, "outage")
    before = lease.deadline

    def down(*_a, **_k):
        raise StoreUnavailable("down")

    monkeypatch.setattr(store.jobs, "beat", down)
    counts = hb.beat()
    assert counts["renewed"] == 0 and not lease.lost  # the deadline timer decides, not the round
    assert lease.deadline == before


def test_a_renewal_moves_the_deadline_from_its_send_time(store, hb, monkeypatch):
    lease = held_lease(store, hb.runtime, "renewed")
    sent = lease.started_at + 1.0
    monkeypatch.setattr(deadline, "monotonic", lambda: sent)
    hb.beat()
    assert lease.deadline == pytest.approx(deadline.local_deadline(sent, 3.0))


def test_a_lease_lost_while_its_renewal_was_out_is_given_back_not_revived(store, hb, monkeypatch):
    lease = held_lease(store, hb.runtime, "late")
    renew = store.jobs.beat

    def slow_answer(*args, **kwargs):
        renewed = renew(*args, **kwargs)
        lease.expire_if_due(lease.deadline)  # the deadline passed while the statement was out
        return renewed

    monkeypatch.setattr(store.jobs, "beat", slow_answer)
    counts = hb.beat()
    assert counts["renewed"] == 0 and lease.lost and "local deadline" in lease.lost_reason
    job = store.get("late")
    assert (job.status, job.lock_token) == ("pending", None)  # given back, fenced on the token
    assert [e["event"] for e in store.reports.events("late")][-1] == "released_after_local_loss"
    assert lease not in hb.runtime.leases()


def defer(store, lease: Lease, end: RunEnd = RunEnd.RETURNED, then=None) -> None:
    """Defer the settle write ``end`` names, as the run lifecycle does when the store is down."""
    writes = {
        RunEnd.RETURNED: lambda: store.jobs.complete(lease.job_id, lease.token, lease.worker),
        RunEnd.FAILED: lambda: store.jobs.fail(lease.job_id, lease.token, "ValueError: boom", lease.worker),
    }
    lease.runtime.defer(lease, DeferredWrite(end, writes[end], then))


def test_deferred_completion_lands_when_the_store_answers(store, hb):
    lease = held_lease(store, hb.runtime, "deferred")
    defer(store, lease)
    hb.beat()
    assert store.get("deferred").status == "completed"
    assert lease not in hb.runtime.leases()


def test_a_deferred_failure_lands_when_the_store_answers_and_its_dead_letter_follows_once(store, hb):
    lease = held_lease(store, hb.runtime, "deferred-failure")
    followed: list[str] = []
    defer(store, lease, RunEnd.FAILED, lambda: followed.append(lease.job_id))
    hb.beat()
    job = store.get("deferred-failure")
    assert (job.status, job.last_error) == ("failed", "ValueError: boom")
    assert followed == ["deferred-failure"] and lease not in hb.runtime.leases()
    hb.beat()
    assert followed == ["deferred-failure"]


def test_a_deferred_failure_whose_first_try_landed_unanswered_is_followed_by_its_dead_letter(store, hb):
    # The failure committed but its answer was lost: the flush finds the failure its own token wrote
    # (the audit) and sends the dead letter, instead of reading the row as moved on and sending nothing.
    lease = held_lease(store, hb.runtime, "landed-failure")
    assert store.jobs.fail(lease.job_id, lease.token, "ValueError: boom", lease.worker)
    followed: list[str] = []
    lease.runtime.defer(lease, DeferredWrite(
        RunEnd.FAILED, lambda: store.jobs.fail(lease.job_id, lease.token, "ValueError: boom", lease.worker),
        lambda: followed.append(lease.job_id),
        landed=lambda: store.jobs.wrote(lease.job_id, lease.token, Event.FAILED)))
    hb.beat()
    assert followed == ["landed-failure"] and lease not in hb.runtime.leases()
    assert [e["event"] for e in store.reports.events("landed-failure")][-1] == "failed"  # no stale audit


def test_a_deferred_failure_of_a_lease_that_moved_on_writes_and_dead_letters_nothing(store, hb):
    lease = held_lease(store, hb.runtime, "moved-on")
    steal(store, "moved-on")
    followed: list[str] = []
    defer(store, lease, RunEnd.FAILED, lambda: followed.append(lease.job_id))
    hb.beat()
    assert store.get("moved-on").status == "running" and followed == []
    assert lease not in hb.runtime.leases()


def recording_again(store, lease: Lease, outages: int = 0) -> list[str]:
    """Give ``lease`` the lifecycle's record-again (a claim under its own token), refused by an
    unreachable store ``outages`` times first; returns the list of its calls' answers."""
    terms = ClaimTerms(duration=3.0, grace=0.0, max_attempts=3, max_expirations=3, takeover=True)
    calls: list[str] = []

    def record_again() -> bool:
        if len(calls) < outages:
            calls.append("unreachable")
            raise StoreUnavailable("down")
        calls.append("recorded")
        return store.jobs.claim(lease.job_id, lease.worker, lease.token, terms, task_name="t.task", queue="q",
                                payload=lambda: None).claimed

    lease._record_again = record_again
    return calls


def vanish(store, job_id: str) -> None:
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.delete(j).where(j.c.id == job_id))


def test_a_deferred_completion_whose_row_vanished_meanwhile_records_the_job_again_and_completes_it(store, hb):
    # Given a completion deferred through an outage (or a batch a neighbour's fault failed) and the
    # job's row deleted before the store answers again (a restore): the first try's answer applies.
    lease = held_lease(store, hb.runtime, "vanished")
    recording_again(store, lease)
    defer(store, lease)
    vanish(store, "vanished")
    hb.runtime.flush_deferred()  # the round's write, after its renewals (which record a vanished row too)
    job = store.get("vanished")
    assert job is not None and job.status == "completed"
    assert lease not in hb.runtime.leases()


def test_a_completion_whose_vanished_row_the_heartbeat_recorded_again_first_completes_the_job(store, hb):
    # The completion and the heartbeat both find the row gone; the heartbeat records it again first, under
    # this lease's token, so the completion's own record-again is told the job is running.
    from celery_lease.worker.lifecycle import _write

    lease = held_lease(store, hb.runtime, "raced")
    recording_again(store, lease)
    record_again = lease._record_again

    def heartbeat_first() -> bool:
        assert record_again()  # the heartbeat's record-again lands first
        return record_again()  # the completion's: refused, the row running again

    lease._record_again = heartbeat_first
    vanish(store, "raced")
    assert _write(lease, RunEnd.RETURNED, lambda: store.jobs.complete("raced", lease.token, lease.worker))
    assert store.get("raced").status == "completed"  # not left running for the reaper to run again


def test_a_completion_whose_row_vanished_and_whose_record_again_meets_an_outage_waits_for_the_store(
        store, hb):
    from celery_lease.worker.lifecycle import _write

    lease = held_lease(store, hb.runtime, "vanished-down")
    calls = recording_again(store, lease, outages=1)
    vanish(store, "vanished-down")
    def complete() -> bool:
        return store.jobs.complete(lease.job_id, lease.token, lease.worker)

    assert _write(lease, RunEnd.RETURNED, complete) is None  # deferred, as an outage of the write itself is
    assert store.get("vanished-down") is None and lease in hb.runtime.leases()
    hb.runtime.flush_deferred()
    job = store.get("vanished-down")
    assert calls == ["unreachable", "recorded"] and job is not None and job.status == "completed"
    assert lease not in hb.runtime.leases()


def test_a_deferred_completion_the_store_rejects_is_logged_and_audited_as_rejected(store, hb, caplog):
    # Given a completion deferred through an outage longer than the lease (lost on the local
    # clock, still deferred), and the job taken by another owner meanwhile:
    lease = held_lease(store, hb.runtime, "rejected")
    defer(store, lease)
    lease.expire_if_due(lease.deadline)
    steal(store, "rejected")
    with caplog.at_level("INFO", logger="celery_lease.worker.runtime"):
        hb.beat()
    assert store.get("rejected").status == "running"
    assert "stale_completion_rejected" in [e["event"] for e in store.reports.events("rejected")]
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert "stale_deferred_write_rejected" in actions and "deferred_write_landed" not in actions


def test_a_checkpoint_held_back_by_an_outage_is_written_by_the_next_round(store, hb, monkeypatch):
    lease = held_lease(store, hb.runtime, "held-checkpoint")
    write = store.jobs.checkpoint

    def down(*_a, **_k):
        raise StoreUnavailable("down")

    monkeypatch.setattr(store.jobs, "checkpoint", down)
    lease.checkpoint({"step": 3})  # does not raise: kept for the heartbeat
    assert lease.checkpoint_state == {"step": 3} and store.get("held-checkpoint").checkpoint_state() is None
    monkeypatch.setattr(store.jobs, "checkpoint", write)
    hb.beat()
    assert store.get("held-checkpoint").checkpoint_state() == {"step": 3}
    assert lease.pending_checkpoint is None and not lease.lost


def test_a_checkpoint_held_back_by_an_outage_never_lands_after_the_bodys_newer_one(store, hb, monkeypatch):
    # The heartbeat's write of the held-back state is on its way when the body writes a newer one: the store
    # must end with the body's state, or the next attempt resumes from older progress.
    lease = held_lease(store, hb.runtime, "newer-checkpoint")
    write, down = store.jobs.checkpoint, [True]
    older_on_its_way, newer_written = threading.Event(), threading.Event()

    def checkpoint(job_id, token, state, worker=None):
        if down[0]:
            raise StoreUnavailable("down")
        if state == {"step": 1}:
            older_on_its_way.set()
            # Until the body's write lands, or for a while if the body waits for this write to end.
            newer_written.wait(2)
        written = write(job_id, token, state, worker)
        if state == {"step": 2}:
            newer_written.set()
        return written

    monkeypatch.setattr(store.jobs, "checkpoint", checkpoint)
    lease.checkpoint({"step": 1})  # kept for the heartbeat
    down[0] = False
    beat = threading.Thread(target=hb.beat, daemon=True)
    beat.start()
    assert older_on_its_way.wait(10), "the heartbeat did not write the held-back checkpoint"
    body = threading.Thread(target=lease.checkpoint, args=({"step": 2},), daemon=True)
    body.start()
    beat.join(15)
    body.join(15)
    assert not beat.is_alive() and not body.is_alive()
    assert lease.checkpoint_state == {"step": 2} and lease.pending_checkpoint is None
    assert store.get("newer-checkpoint").checkpoint_state() == {"step": 2}


def test_the_beat_registers_the_worker_process(store, hb):
    hb.beat()
    with store.begin() as c:
        ids = c.execute(sa.select(store.t.workers.c.worker_id)).scalars().all()
    assert ids == ["host:1"]


def test_the_thread_renews_on_its_own(store, hb):
    held_lease(store, hb.runtime, "looped")
    hb.start()
    wait_for(lambda: hb.beats >= 2, timeout=5, message="heartbeat thread did not beat twice")


def test_a_round_that_raises_is_logged_and_the_thread_beats_on_one_interval_later(store, caplog, monkeypatch):
    # Another test's worker may have reconfigured logging: make sure this logger reaches caplog.
    logger = logging.getLogger("celery_lease.worker.heartbeat")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    rt = Runtime(store, "host", default_interval=0.1, worker="host:3")
    hb = rt.heartbeat
    real_beat, rounds = hb.beat, []

    def beat() -> dict[str, int]:
        rounds.append(deadline.monotonic())
        if len(rounds) == 1:
            raise RuntimeError("bad round")
        return real_beat()

    hb.beat = beat
    try:
        with caplog.at_level("ERROR", logger="celery_lease.worker.heartbeat"):
            hb.start()
            wait_for(lambda: hb.beats >= 1, timeout=5, message="the thread did not outlive the bad round")
        failed = [r for r in caplog.records if r.getMessage() == "heartbeat round of host:3 failed"]
        assert failed and failed[0].exc_info
        assert rounds[1] - rounds[0] >= 0.1  # the failed round counts as a round: the next waits its interval
    finally:
        rt.stop()


def test_a_lease_with_a_shorter_interval_brings_the_next_beat_forward(store):
    rt = Runtime(store, "host", default_interval=30.0, worker="host:2")
    hb = rt.heartbeat
    try:
        hb.start()
        wait_for(lambda: hb.beats >= 1, timeout=5, message="no first beat")
        held_lease(store, rt, "urgent")  # interval 0.2 s, far below the planned 30 s
        wait_for(lambda: hb.beats >= 3, timeout=3, message="the thread kept its 30 s plan")
    finally:
        rt.stop()


def test_a_round_landing_inside_a_hand_over_leaves_the_handed_over_row_alone(store, hb):
    """A replace removes the row, then flags the lease handed over: a round between the two
    must neither record the row again (the job would run twice) nor call the lease lost."""
    lease = held_lease(store, hb.runtime, "handing")
    terms = ClaimTerms(duration=3.0, grace=0.0, max_attempts=3, max_expirations=3, takeover=True)

    def record_again() -> bool:  # what the lifecycle hands a lease: the job recorded anew under its token
        again = store.jobs.claim("handing", hb.runtime.worker, lease.token, terms, task_name="t.task",
                                 queue="q",
                                 payload=lambda: "{}")
        return again.claimed and again.job is not None and again.job.lock_token == lease.token

    lease._record_again = record_again
    hb.beat()
    with lease.turn:  # held by replacing.py from the hand-over's write until its flag is set
        assert store.replacing.hand_over("handing", lease.token, hb.runtime.worker, None, "t.carrier")
        round_ = threading.Thread(target=hb.beat)
        round_.start()
        round_.join(timeout=1.0)  # a round that does not wait for the hand-over ends here
        lease.handed_over = True
    round_.join(timeout=10)
    assert not round_.is_alive()
    assert store.get("handing") is None, "the round recorded the handed-over row again"
    assert not lease.lost
