"""The worker process's runtime: leases by request and token, the deadline timer, give-backs."""

from __future__ import annotations

import secrets
import sys
import threading
import time

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_lease import LeaseTask, deadline
from celery_lease.config import load
from celery_lease.errors import LeaseLost, StoreUnavailable
from celery_lease.store import ClaimTerms
from celery_lease.vocabulary import RunEnd
from celery_lease.worker import interrupt, runtime
from celery_lease.worker.lease import DeferredWrite, Lease
from celery_lease.worker.locks import ResourceLock, lock
from celery_lease.worker.runtime import Runtime
from tests.helpers import text_result_column, wait_for


def policy(**overrides):
    return load({}).policy({"lease_duration": 3.0, "lease_heartbeat_interval": 0.2, **overrides})


class Request:
    """Stands for a Celery request context."""


def claim(store, rt: Runtime, job_id: str, duration: float = 3.0, **overrides) -> Lease:
    """Record (if new) and claim ``job_id`` (taking over a lapsed lease); the runtime's Lease."""
    store.publishes.record(job_id, "t.task", "q", "{}", 5)
    tok = secrets.token_hex(16)
    sent = deadline.monotonic()
    store.hard_grace, store.stale_after = 0.0, 10.0  # a lapsed lease is taken over at once
    terms = ClaimTerms(duration=duration, grace=0.0, max_attempts=5, max_expirations=5, takeover=True)
    got = store.jobs.claim(job_id, rt.worker, tok, terms, task_name="t.task", queue="q", payload=lambda: None)
    assert got.claimed, got
    return Lease(rt, job_id, tok, got.job.attempt_count, policy(lease_duration=duration, **overrides),
                 f"t.task:{job_id}", None, sent_at=sent)


def lapse(store, job_id: str) -> None:
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lease_expires_at=store.now_sql - 1.0))


@pytest.fixture
def rt(store):
    runtime_ = Runtime(store, "host", default_interval=0.2, worker="host:1")
    runtime_.start = lambda: None  # rounds and timer passes driven by hand
    yield runtime_
    runtime_.stop()


def count_statements(store):
    seen: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    return seen


def test_check_refuses_past_the_local_deadline_without_asking_the_store(store, rt, monkeypatch):
    lease = claim(store, rt, "job-1")
    rt.attach(Request(), lease)
    lease.check()  # within the deadline
    statements = count_statements(store)
    monkeypatch.setattr(deadline, "monotonic", lambda: lease.deadline)
    with pytest.raises(LeaseLost, match="local deadline passed"):
        lease.check()
    assert statements == []


def test_the_timer_marks_leases_lost_at_their_deadline_and_returns_the_next_one(store, rt):
    early, late = claim(store, rt, "job-early", duration=3.0), claim(store, rt, "job-late", duration=30.0)
    rt.attach(Request(), early)
    rt.attach(Request(), late)
    assert rt.timer.run_once(early.deadline - 0.01) == early.deadline
    assert not early.lost
    assert rt.timer.run_once(early.deadline) == late.deadline
    assert early.lost and not late.lost
    assert rt.leases() == [late]  # no longer renewed


def test_a_lease_due_after_the_timers_next_look_does_not_wake_it_and_an_earlier_one_does(store):
    rt = Runtime(store, "host", default_interval=0.2, worker="host:3")
    try:
        first = claim(store, rt, "job-1", duration=30.0)
        rt.attach(Request(), first)  # starts the thread, which then sleeps (5 s at most)
        wait_for(lambda: rt.timer._planned is not None, timeout=5, message="the timer never planned")
        planned = rt.timer._planned
        assert planned <= first.deadline
        rt.timer._loop.woken.clear()
        rt.timer.watch(planned + 30.0)
        assert not rt.timer._loop.woken.is_set()  # it looks again before that lease is due anyway
        rt.timer.watch(planned - 0.5)
        assert rt.timer._loop.woken.is_set()
    finally:
        rt.stop()


def test_the_timer_thread_interrupts_a_busy_body_on_time(store):
    rt = Runtime(store, "host", default_interval=0.2, worker="host:2")
    lease = claim(store, rt, "job-1", duration=1.0, lease_heartbeat_interval=0.3)
    rt.heartbeat.start = lambda: None  # no renewals: only the deadline speaks
    caught: list[tuple[BaseException, float]] = []

    def body() -> None:
        try:
            with lease.body():
                end = time.monotonic() + 10
                while time.monotonic() < end:
                    sum(range(100))
        except LeaseLost as exc:
            caught.append((exc, deadline.monotonic()))

    worker = threading.Thread(target=body)
    try:
        rt.attach(Request(), lease)
        worker.start()
        worker.join(10)
    finally:
        rt.stop()
    [(exc, at)] = caught
    assert "local deadline passed" in str(exc)
    # Well before the body's own end (10 s): the timer thread, not the loop, stopped it. The slack
    # is for a loaded 2-core machine, where the timer thread may wait for the GIL and the CPU.
    assert lease.deadline <= at < lease.deadline + 2.0


class _LateInterrupter(interrupt.ThreadInterrupter):
    """Marks the moment a loss was flagged and holds the interruption back a while, as the
    timer does while it logs the loss: the window in which the body may see ``lost`` first."""

    flagged = threading.Event()
    body_raised = threading.Event()

    def interrupt(self, error, still_running):
        self.flagged.set()
        self.body_raised.wait(1.0)
        super().interrupt(error, still_running)


@pytest.mark.parametrize("found_by", ["lease", "resource lock"])
def test_a_body_that_raises_lease_lost_itself_is_not_interrupted_again_in_its_handlers(store, found_by):
    rt = Runtime(store, "host", default_interval=0.2, worker="host:3", interrupter=_LateInterrupter)
    rt.start = lambda: None
    _LateInterrupter.flagged.clear()
    _LateInterrupter.body_raised.clear()
    lease = claim(store, rt, "job-1")
    held = ResourceLock("invoice-7", secrets.token_hex(16), 5.0, lease)
    in_body = threading.Event()
    seen: list[str] = []

    def flag_the_loss() -> None:
        in_body.wait(10)
        if found_by == "resource lock":
            held.lost = True  # the heartbeat flags the lock, then the lease (locks.Locks.renew)
        lease.mark_lost("taken_over")

    def body() -> None:
        try:
            with lease.body():
                in_body.set()
                assert _LateInterrupter.flagged.wait(10)
                try:
                    # Sees the loss while the other thread still holds the interruption back.
                    lease.check() if found_by == "lease" else held.check()
                except LeaseLost:
                    _LateInterrupter.body_raised.set()
                    marker.join(10)
                    for _ in range(100_000):  # a queued interruption lands at one of these bytecodes
                        pass
                    seen.append("handler ran to its end")
        except LeaseLost:
            seen.append("a second LeaseLost")

    worker = threading.Thread(target=body)
    marker = threading.Thread(target=flag_the_loss)
    worker.start()
    marker.start()
    worker.join(10)
    rt.stop()
    assert seen == ["handler ran to its end"]


def test_a_loss_during_a_store_call_of_the_body_interrupts_it_once_the_call_has_ended(store, rt):
    lease = claim(store, rt, "job-1")
    inside, flagged = threading.Event(), threading.Event()
    seen: list[str] = []

    def body() -> None:
        try:
            with lease.body():
                # A store call of the body: it holds a pooled connection (and SQLite's writer turn).
                with store.begin() as c:
                    inside.set()
                    assert flagged.wait(10)
                    for _ in range(100_000):  # an interruption not held back lands at one of these
                        pass
                    c.execute(sa.select(sa.literal(1)))
                    seen.append("the call ran to its end")
                seen.append("after the call")
        except LeaseLost as exc:
            seen.append(f"LeaseLost: {exc.reason}")

    worker = threading.Thread(target=body)
    worker.start()
    assert inside.wait(10)
    lease.mark_lost("taken_over")
    flagged.set()
    worker.join(10)
    assert seen == ["the call ran to its end", "LeaseLost: taken_over"]
    # The connection and the writer turn went back: a write from another thread goes through.
    assert store.publishes.record("job-2", "t.task", "q", "{}", 5) == (True, "job-2")


class _HeldInterrupter(interrupt.ThreadInterrupter):
    """Keeps the interruption on its way, as gevent's hub does until it runs the throw."""

    held: list = []

    def interrupt(self, error, still_running):
        self.held.append(still_running)


def test_a_store_call_begun_after_the_loss_raises_lease_lost_before_any_statement(store):
    rt = Runtime(store, "host", default_interval=0.2, worker="host:4", interrupter=_HeldInterrupter)
    rt.start = lambda: None
    _HeldInterrupter.held.clear()
    lease = claim(store, rt, "job-1")
    statements = count_statements(store)
    raised: list[LeaseLost] = []

    def body() -> None:
        with lease.body():
            lease.mark_lost("taken_over")
            try:
                store.get("job-1")
            except LeaseLost as exc:
                raised.append(exc)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join(10)
    rt.stop()
    assert [exc.reason for exc in raised] == ["taken_over"]
    assert statements == []
    # The interruption still on its way is refused when it arrives: one loss, one LeaseLost.
    [still_running] = _HeldInterrupter.held
    assert still_running() is False


def test_a_store_call_from_a_thread_that_copied_the_bodys_context_leaves_the_body_its_interruption(
        store, rt):
    import contextvars

    lease = claim(store, rt, "job-1")
    seen: list[str] = []

    def helper() -> None:  # as asyncio.to_thread runs it: in a copy of the body's context
        store.get("job-1")
        seen.append("the helper's call ran")

    def body() -> None:
        try:
            with lease.body():
                lease.mark_lost("taken_over")  # from the body's own thread: nothing sent yet
                context = contextvars.copy_context()
                thread = threading.Thread(target=context.run, args=(helper,))
                thread.start()
                thread.join(10)
                lease.check()
        except LeaseLost as exc:
            seen.append(f"the body's LeaseLost: {exc.reason}")

    worker = threading.Thread(target=body)
    worker.start()
    worker.join(10)
    assert seen == ["the helper's call ran", "the body's LeaseLost: taken_over"]


def test_two_claims_of_one_job_in_one_process_keep_their_own_leases(store, rt):
    # Given a stale claim of job-1 and a new one (taken over) in the same process
    stale_request, new_request = Request(), Request()
    stale = claim(store, rt, "job-1")
    rt.attach(stale_request, stale)
    lapse(store, "job-1")
    new = claim(store, rt, "job-1")
    rt.attach(new_request, new)
    assert (rt.lease_for(stale_request), rt.lease_for(new_request)) == (stale, new)
    # When a round renews them: only the token the row carries is renewed
    counts = rt.heartbeat.beat()
    assert counts["renewed"] == 1 and counts["lost"] == 1
    assert stale.lost and stale.lost_reason == "taken_over" and not new.lost
    # And the stale body's end leaves the new lease alone
    rt.detach(stale_request, stale)
    assert rt.lease_for(new_request) is new and rt.leases() == [new]
    new.check()


@pytest.mark.parametrize(("timelimit", "max_runtime"), [((30, None), 30.0), (None, 5.0), ((None, 20), 5.0)])
def test_a_per_call_time_limit_is_the_default_max_runtime_of_its_run(tmp_path, timelimit, max_runtime):
    # apply_async(time_limit=30) on a task whose time_limit is 5: Celery lets the run go 30 s, so its lease is
    # renewed that long (it was cut at 5 s, the run taken back, run again and dead-lettered).
    from celery.app.trace import build_tracer

    url = f"sqlite:///{tmp_path / 'store.db'}"
    app = Celery("rt_limit", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(lease_store_url=url)

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.limited", time_limit=5, acks_late=True)
    def limited(self):
        return self.lease.policy.max_runtime

    app.finalize()
    from celery_lease.store import Store

    Store(url).migrate()
    job_id = limited.apply_async().id
    tracer = build_tracer(limited.name, limited, app=app, eager=False, propagate=True)
    request = {"id": job_id, "task": limited.name, "hostname": "rt@test", "headers": {}, "is_eager": False,
               "timelimit": timelimit, "delivery_info": {"routing_key": "celery", "exchange": ""}}
    assert tracer(job_id, (), {}, request)[0] == max_runtime


def test_self_lease_resolves_through_the_current_request(store):
    app = Celery("rt_resolve", set_as_current=False)
    app.conf.update(lease_store_url=store.engine.url.render_as_string(hide_password=False))

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.task")
    def task(self):  # pragma: no cover - never called
        return None

    rt = runtime.for_app(app, store, "host")
    rt.start = lambda: None
    first, second = claim(store, rt, "job-1"), claim(store, rt, "job-2")
    # The runtime keys leases by the request object's id until detach; the test keeps both
    # requests alive as the worker does, so a new object cannot take a popped one's id.
    task.push_request(id="job-1")
    outer = task.request
    rt.attach(outer, first)
    task.push_request(id="job-1")  # a second claim of the same id, in the same process
    inner = task.request
    rt.attach(inner, second)
    assert task.lease is second
    task.pop_request()
    assert task.lease is first
    task.pop_request()
    assert task.lease is None
    rt.detach(inner, second)
    rt.detach(outer, first)


def test_a_lease_past_its_max_runtime_is_lost_at_its_deadline_and_left_to_expire(store, rt, monkeypatch):
    lease = claim(store, rt, "hung", lease_max_runtime=0.5)
    rt.attach(Request(), lease)
    later = lease.started_at + 1.0
    monkeypatch.setattr(deadline, "monotonic", lambda: later)
    assert rt.heartbeat.beat()["renewed"] == 0  # past lease_max_runtime: not renewed
    rt.timer.run_once(lease.deadline)
    assert lease.lost and "lease_max_runtime" in lease.lost_reason
    rt.heartbeat.beat()
    job = store.get("hung")  # not given back: the reaper counts the expiration
    assert (job.status, job.lock_token) == ("running", lease.token)


def test_the_locks_of_an_overrun_lease_are_not_renewed_and_are_freed_when_it_is_lost(store, rt, monkeypatch):
    lease = claim(store, rt, "hung", lease_max_runtime=0.5, lease_on_lost="flag")
    rt.attach(Request(), lease)
    with lock(lease, "account:1", ttl=3.0):
        expiry = store.reports.lock_holder("account:1")["expires_at"]
        later = lease.started_at + 1.0
        monkeypatch.setattr(deadline, "monotonic", lambda: later)
        rt.heartbeat.beat()
        assert store.reports.lock_holder("account:1")["expires_at"] == expiry
        rt.timer.run_once(lease.deadline)
        rt.heartbeat.beat()
        assert store.reports.lock_holder("account:1") is None


def test_a_lease_lost_in_a_store_outage_is_given_back_once_the_store_answers(store, rt, monkeypatch):
    lease = claim(store, rt, "cut-off")
    rt.attach(Request(), lease)
    beat = store.jobs.beat

    def down(*_a, **_k):
        raise StoreUnavailable("down")

    monkeypatch.setattr(store.jobs, "beat", down)
    rt.heartbeat.beat()
    rt.timer.run_once(lease.deadline)
    assert lease.lost
    monkeypatch.setattr(store.jobs, "beat", beat)
    rt.heartbeat.beat()
    job = store.get("cut-off")
    assert (job.status, job.lock_token, job.attempt_count) == ("pending", None, 0)
    assert store.reports.events("cut-off", "released_after_local_loss")
    assert rt.leases() == []


def test_a_late_renewal_does_not_revive_a_lost_lease(store, rt):
    lease = claim(store, rt, "job-1")
    rt.attach(Request(), lease)
    before = lease.deadline
    rt.timer.run_once(before)
    assert not lease.confirm(deadline.monotonic())
    assert lease.lost and lease.deadline == before


def test_release_all_in_process_gives_back_every_lease_and_stops_the_threads(store):
    app = Celery("rt_release", set_as_current=False)
    app.conf.update(lease_store_url=store.engine.url.render_as_string(hide_password=False))
    rt = runtime.for_app(app, store, "host")
    lease = claim(store, rt, "job-1")
    rt.attach(Request(), lease)
    assert runtime.release_all_in_process() >= 1
    assert store.get("job-1").status == "pending" and lease.lost
    assert not rt.timer._loop.thread.is_alive() and not rt.heartbeat._loop.thread.is_alive()


# -- cancels the store did not take ----------------------------------------------------------
@pytest.fixture
def cut_store(postgres_url):
    """A migrated PostgreSQL store reached through a proxy the test can cut, and that proxy."""
    from urllib.parse import urlsplit, urlunsplit

    from celery_lease.store import Store
    from tests.conftest import unique_prefix
    from tests.tcp_proxy import TcpProxy

    pg = urlsplit(postgres_url)
    proxy = TcpProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start()
    direct = Store(postgres_url, unique_prefix())
    direct.migrate()
    store = Store(urlunsplit(pg._replace(netloc=f"{pg.username}@127.0.0.1:{proxy.port}")), direct.prefix)
    yield proxy, store, direct
    proxy.cut()
    store.engine.dispose()
    direct.drop_schema()
    direct.engine.dispose()


def test_a_cancel_that_meets_an_outage_is_kept_and_written_once_the_store_answers(cut_store):
    proxy, store, direct = cut_store
    for job_id in ("j1", "j2"):
        direct.publishes.record(job_id, "t.task", "q", "{}", 3)
    cancels = runtime.PendingWrites(store, interval=0.1)
    # Given a store that does not answer, when two jobs are revoked
    proxy.cut()
    assert cancels.cancel("j1", "revoked") is False
    assert cancels.cancel("j2", "expired") is False
    assert len(cancels) == 2 and direct.get("j1").status == "pending"
    # Then both cancels reach the store once it answers, without another cancel to carry them
    proxy.start()
    wait_for(lambda: len(cancels) == 0, timeout=10, message="the kept cancels were never written")
    assert [(direct.get(j).status, direct.get(j).last_error) for j in ("j1", "j2")] == [
        ("failed", "revoked (revoked)"), ("failed", "revoked (expired)")]
    assert cancels.cancel("j3", "revoked") is True  # nothing kept: an unknown job is a no-op write


class FlakyCancels:
    """A store whose cancel() fails while ``down`` is set, and records the cancels it took."""

    def __init__(self) -> None:
        self.down = True
        self.written: list[str] = []
        self.jobs = self  # the store's group of the worker's job writes

    def cancel(self, job_id: str, **_: object) -> None:
        if self.down:
            raise StoreUnavailable("down")
        self.written.append(job_id)


def test_the_kept_cancels_thread_ends_once_none_is_left_and_the_next_outage_starts_another():
    store = FlakyCancels()
    cancels = runtime.PendingWrites(store, interval=0.05)
    assert cancels.cancel("j1", "revoked") is False
    first = cancels._loop.thread
    assert first is not None
    store.down = False
    wait_for(lambda: store.written == ["j1"], timeout=5, message="the kept cancel was never written")
    first.join(5)
    assert not first.is_alive()  # nothing left to write: the thread ended
    store.down = True
    assert cancels.cancel("j2", "revoked") is False
    assert cancels._loop.thread is not first and cancels._loop.running()
    store.down = False
    wait_for(lambda: store.written == ["j1", "j2"], timeout=5, message="the second outage's cancel was lost")


def test_a_kept_cancel_does_not_replace_a_kept_completion_of_the_same_job():
    store = FlakyCancels()
    kept = runtime.PendingWrites(store, interval=60.0)
    completed: list[str] = []

    def complete() -> None:
        if store.down:
            raise StoreUnavailable("down")
        completed.append("j1")

    kept.keep("j1", "completion", complete)
    assert kept.cancel("j1", "expired") is False
    assert len(kept) == 2
    store.down = False
    assert kept.flush() == 2
    assert (completed, store.written, len(kept)) == (["j1"], ["j1"], 0)


def test_a_kept_write_that_fails_other_than_by_the_store_is_dropped_and_blocks_no_later_write():
    # A kept dead letter whose broker is down (or whose stored message cannot be read): retried ahead of
    # every other kept write, it would hold back a revoke's cancel and every completion for ever.
    store = FlakyCancels()
    kept = runtime.PendingWrites(store, interval=60.0)

    def broker_down() -> None:
        raise ConnectionError("broker down")

    kept.keep("j1", "dead letter", broker_down)
    store.down = False
    assert kept.cancel("j2", "revoked") is True
    assert (store.written, len(kept)) == (["j2"], 0)


def test_a_write_kept_through_an_outage_is_made_at_shutdown_when_the_store_answers_again(store, rt):
    # Given a cancel that found the store away and was kept (the store answers again)
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    rt.kept_writes.keep("j1", "cancel", lambda: store.jobs.cancel("j1", reason="revoked"))
    rt.kept_writes._loop.stop()  # no retry round before the shutdown: the shutdown must make it
    rt.release_all()
    assert store.get("j1").status == "failed" and len(rt.kept_writes) == 0


def deferred_completion(store, rt: Runtime, job_id: str, unanswered: int,
                        duration: float = 3.0) -> tuple[Lease, list[float]]:
    """A returned body's completion, deferred by an outage that fails its next ``unanswered`` tries too;
    the lease and when each try was made."""
    lease = claim(store, rt, job_id, duration=duration)
    rt.attach(Request(), lease)
    tries: list[float] = []

    def complete() -> bool:
        tries.append(deadline.monotonic())
        if len(tries) <= unanswered:
            raise StoreUnavailable("no answer (injected)")
        return store.jobs.complete(lease.job_id, lease.token, lease.worker)

    rt.defer(lease, DeferredWrite(RunEnd.RETURNED, complete))
    return lease, tries


def test_a_deferred_completion_lands_at_shutdown_when_the_outage_ends_within_its_lease(store, rt):
    # Given a completion deferred by an outage that fails its next three tries
    lease, tries = deferred_completion(store, rt, "job-1", unanswered=3)
    # When the process shuts down while the store is still away
    rt.release_all()
    # Then the shutdown kept trying until it landed: the job is completed, not left running for the reaper
    assert store.get("job-1").status == "completed" and not rt.is_deferred(lease) and lease not in rt.leases()
    assert len(tries) == 4


def test_a_deferred_completion_is_dropped_at_shutdown_with_an_error_once_its_lease_deadline_passes(store, rt,
                                                                                                  caplog):
    # Given a completion deferred on a one-second lease by an outage that does not end
    lease, tries = deferred_completion(store, rt, "job-1", unanswered=sys.maxsize, duration=1.0)
    # When the process shuts down
    with caplog.at_level("ERROR", logger="celery_lease.worker.runtime"):
        rt.release_all()
    returned = deadline.monotonic()
    # Then it kept trying up to the lease's local deadline, and returned shortly after it
    assert len(tries) > 2 and lease.deadline <= returned < lease.deadline + 0.5
    # And the dropped completion is reported: the job, its end, and that the job runs again
    [error] = [r for r in caplog.records if getattr(r, "action", None) == "settle_lost_at_exit"]
    assert error.levelname == "ERROR" and all(word in error.getMessage() for word in ("job-1", "returned",
                                                                                       "runs again"))
    assert store.get("job-1").status == "running" and not rt.is_deferred(lease) and lease not in rt.leases()


def test_an_exit_waits_no_longer_than_its_cap_for_a_store_that_stays_away(store, rt, monkeypatch):
    # A lease extended far ahead would otherwise hold the exit for its whole duration, past the grace a
    # container is given to stop.
    monkeypatch.setattr("celery_lease.worker.at_exit.EXIT_SETTLE_WAIT", 0.5)
    lease, tries = deferred_completion(store, rt, "job-1", unanswered=sys.maxsize, duration=60.0)
    began = deadline.monotonic()
    rt.release_all()
    assert deadline.monotonic() - began < 5.0 and len(tries) >= 2
    assert not rt.is_deferred(lease) and store.get("job-1").status == "running"


def test_a_deferred_write_and_what_follows_it_are_made_once_when_two_threads_flush(store, rt):
    # The heartbeat flushes while an exit does: both would make the write, and run its follow-up twice.
    lease = claim(store, rt, "job-1")
    rt.attach(Request(), lease)
    followed: list[str] = []

    def complete() -> bool:
        written = store.jobs.complete(lease.job_id, lease.token, lease.worker)
        if len(followed) == 0 and not tries:
            tries.append(1)
            other = threading.Thread(target=rt.flush_deferred)  # the other flush, between commit and answer
            other.start()
            other.join(10)
        return written

    tries: list[int] = []
    rt.defer(lease, DeferredWrite(RunEnd.RETURNED, complete, lambda: followed.append("then"),
                                  lambda: store.get(lease.job_id).status == "completed"))
    rt.flush_deferred()
    assert followed == ["then"] and store.get("job-1").status == "completed"


@pytest.mark.parametrize("store_url", ["mysql"], indirect=True)
def test_a_deferred_completion_the_store_refuses_for_good_is_not_retried_every_round(store_factory, caplog):
    """A completion deferred in an outage and then refused (a 70 KB result on a MySQL/MariaDB
    result column of TEXT, as before revision 0007) is reported once and given up: never
    the same write again at every heartbeat."""
    store = store_factory(migrate=False, reuse=False)
    text_result_column(store)
    rt = Runtime(store, "host", default_interval=0.2, worker="host:1")
    rt.start = lambda: None
    try:
        lease = claim(store, rt, "too-big")
        rt.attach(Request(), lease)
        kept = '"' + "r" * 70_000 + '"'
        rt.defer(lease, DeferredWrite(RunEnd.RETURNED,
                                      lambda: store.jobs.complete(lease.job_id, lease.token, lease.worker,
                                                                  kept)))
        with caplog.at_level("ERROR", logger="celery_lease.worker.runtime"):
            rt.flush_deferred()
        assert not rt.is_deferred(lease) and lease not in rt.leases()
        assert any("rejected by the store" in r.getMessage() and "too-big" in r.getMessage()
                   for r in caplog.records)
        statements = count_statements(store)
        rt.flush_deferred()
        assert statements == []
    finally:
        rt.stop()


@pytest.mark.parametrize("store_url", ["mysql"], indirect=True)
def test_a_deferred_completion_whose_kept_result_is_refused_completes_without_it(store_factory, monkeypatch):
    """As at once, so when deferred: the kept result only serves a crash's post-run work, and a job left
    running after its body returned would be run again by the reaper."""
    from celery_lease.worker import lifecycle

    store = store_factory(migrate=False, reuse=False)
    text_result_column(store)  # the kept result is too long for this store's column
    rt = Runtime(store, "host", default_interval=0.2, worker="host:1")
    rt.start = lambda: None
    app = Celery("kept_refused", broker="memory://", backend="cache+memory://", set_as_current=False)

    @app.task(name="t.big", shared=False)
    def big() -> str:
        return "r" * 70_000

    try:
        lease = claim(store, rt, "too-big")
        rt.attach(Request(), lease)
        complete = store.jobs.complete

        def unanswered_once(*args, **kwargs) -> bool:
            monkeypatch.setattr(store.jobs, "complete", complete)
            raise StoreUnavailable("no answer within the call bound (injected)")

        monkeypatch.setattr(store.jobs, "complete", unanswered_once)
        big.push_request(id="too-big")
        try:
            assert lifecycle.settle(big, lease, RunEnd.RETURNED, "r" * 70_000, None) == "r" * 70_000
        finally:
            big.pop_request()
        assert rt.is_deferred(lease)
        rt.flush_deferred()
        job = store.get("too-big")
        assert (job.status, store.jobs.kept_result("too-big")) == ("completed", None)
    finally:
        rt.stop()
        app.close()


def _clocks(store, lease: Lease) -> tuple[float, float]:
    """(seconds the store keeps the lease, seconds the worker still trusts it), read together."""
    local_left = lease.deadline - deadline.monotonic()
    store_left = store.get(lease.job_id).lease_expires_at - store.now()
    return store_left, local_left


@pytest.mark.parametrize("seconds", [5.0, 60.0])
def test_extend_moves_the_stores_expiry_and_the_local_deadline_together(store, rt, seconds):
    # Given a 30 s lease
    lease = claim(store, rt, "job-1", duration=30.0)
    rt.attach(Request(), lease)
    # When the body extends it to a shorter or a longer lease
    lease.extend(seconds)
    # Then both clocks count `seconds` from the renewal, the local one first, by the margin
    store_left, local_left = _clocks(store, lease)
    assert local_left < store_left <= seconds
    assert store_left - local_left == pytest.approx(deadline.safety_margin(seconds), abs=0.5)
    # And the heartbeat renews for the new duration on both clocks
    rt.heartbeat.beat()
    store_left, local_left = _clocks(store, lease)
    assert local_left < store_left <= seconds and store_left > seconds - 1.0


def test_an_extend_the_store_lost_is_written_again_by_the_heartbeat_and_never_trusted_beyond_the_store(
        store, rt):
    # Given a 30 s lease extended to 300 s
    lease = claim(store, rt, "job-1", duration=30.0)
    rt.attach(Request(), lease)
    lease.extend(300.0)
    # When the store loses the extend (a failover to a standby without its commit)
    with store.begin() as c:
        c.execute(sa.update(store.t.jobs).where(store.t.jobs.c.id == "job-1").values(lease_duration=30.0))
    # Then the next heartbeat renews it for 300 s again, and the worker trusts no more than that
    rt.heartbeat.beat()
    store_left, local_left = _clocks(store, lease)
    assert local_left < store_left <= 300.0 and store_left > 299.0
    # When the row vanishes (a restore) and the heartbeat records it again with its claim's 30 s
    terms = ClaimTerms(duration=30.0, grace=0.0, max_attempts=5, max_expirations=5, takeover=True)
    lease._record_again = lambda: store.jobs.claim("job-1", rt.worker, lease.token, terms, task_name="t.task",
                                                   queue="q", payload=lambda: None).claimed
    with store.begin() as c:
        c.execute(sa.delete(store.t.jobs).where(store.t.jobs.c.id == "job-1"))
    rt.heartbeat.beat()
    store_left, local_left = _clocks(store, lease)
    assert not lease.lost and local_left < store_left <= 30.0
    # Then the heartbeat after writes the extend again
    rt.heartbeat.beat()
    store_left, local_left = _clocks(store, lease)
    assert local_left < store_left <= 300.0 and store_left > 299.0


def test_an_extend_the_store_does_not_answer_is_trusted_only_for_the_shorter_lease(store, rt, monkeypatch):
    # Given a 30 s lease whose store stops answering
    lease = claim(store, rt, "job-1", duration=30.0)
    rt.attach(Request(), lease)

    def unanswered(*args, **kwargs):
        raise StoreUnavailable("no answer")

    monkeypatch.setattr(store.jobs, "renew", unanswered)
    # When the body shortens it to 1 s (the statement may have run, its answer lost)
    sent = deadline.monotonic()
    with pytest.raises(LeaseLost, match="local deadline passed"):
        lease.extend(1.0)
    # Then the body waited for the store only until the shorter lease's deadline, not the 30 s one
    assert deadline.monotonic() < sent + 2.0
    assert lease.deadline <= deadline.local_deadline(deadline.monotonic(), 1.0)


def test_an_extend_beside_a_heartbeat_round_never_leaves_the_worker_trusting_more_than_the_store(
        store, rt, monkeypatch):
    # Given a 30 s lease extended to 60 s, whose heartbeat round has read that duration and is about to
    # write it again (an extended lease's renewals carry its duration)
    lease = claim(store, rt, "job-1", duration=30.0)
    rt.attach(Request(), lease)
    lease.extend(60.0)
    beat = store.jobs.beat
    extended = threading.Event()
    extender = threading.Thread(target=lambda: (lease.extend(300.0), extended.set()), daemon=True)

    def extend_meanwhile(*args, **kwargs):
        # When the body extends the lease to 300 s while that round's statement is on its way
        extender.start()
        extended.wait(2.0)  # an extend that must wait for the round does not end here
        return beat(*args, **kwargs)

    monkeypatch.setattr(store.jobs, "beat", extend_meanwhile)
    rt.heartbeat.beat()
    extender.join(30)
    assert extended.is_set(), "the extend never ended"
    # Then the worker trusts the lease no longer than the store keeps it, whichever statement came last
    store_left, local_left = _clocks(store, lease)
    assert local_left < store_left, f"worker trusts {local_left:.1f}s, the store keeps {store_left:.1f}s"


@pytest.fixture
def running_rt(store):
    """A runtime whose heartbeat and deadline timer run on their threads, renewing every 3 s."""
    runtime_ = Runtime(store, "host", default_interval=3.0, worker="host:1")
    yield runtime_
    runtime_.stop()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # the threads, on any store
def test_a_lease_shortened_by_extend_is_renewed_in_time_while_the_store_answers(store, running_rt):
    # A 30 s lease renewed every 3 s, shortened to 1.5 s: each later heartbeat renews it for 1.5 s, so they
    # must come sooner than every 3 s, or a healthy worker loses its job.
    lease = claim(store, running_rt, "job-1", duration=30.0, lease_heartbeat_interval=3.0)
    running_rt.attach(Request(), lease)
    lease.extend(1.5)
    extended = lease.confirmed_at
    wait_for(lambda: lease.lost or lease.confirmed_at > extended + 4.5, timeout=20,
             message="the shortened lease was neither renewed nor lost")
    assert not lease.lost, lease.lost_reason
    assert 0.0 < store.get("job-1").lease_expires_at - store.now() <= 1.5


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # the threads, on any store
def test_a_lease_shortened_by_extend_is_lost_by_its_own_deadline_when_the_store_stops_answering(
        store, running_rt, monkeypatch):
    # The deadline timer was asleep for the 30 s lease: it must look again by the 1.5 s one's deadline, not
    # seconds after the store's expiry (another worker may take the job then).
    lease = claim(store, running_rt, "job-1", duration=30.0, lease_heartbeat_interval=3.0)
    running_rt.attach(Request(), lease)
    wait_for(lambda: running_rt.timer._planned is not None, timeout=5, message="the timer never planned")

    def unanswered(*args, **kwargs):
        raise StoreUnavailable("no answer")

    monkeypatch.setattr(store.jobs, "beat", unanswered)
    lease.extend(1.5)
    extended = deadline.monotonic()
    wait_for(lambda: lease.lost, timeout=15, message="the shortened lease was never lost")
    assert deadline.monotonic() - extended < 3.0, "lost seconds after the store's expiry"
    assert "local deadline passed" in lease.lost_reason


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf")])
def test_extend_refuses_a_duration_that_is_not_a_positive_number(store, rt, seconds):
    lease = claim(store, rt, "job-1")
    with pytest.raises(ValueError, match="seconds > 0"):
        lease.extend(seconds)


def test_the_deadline_timer_marks_a_lease_lost_at_its_locks_deadline(store, rt):
    lease = claim(store, rt, "job-1", duration=30.0)
    rt.attach(Request(), lease)
    with lock(lease, "invoice-7", ttl=3.0) as held:
        # The next look is the lock's deadline, long before the lease's
        due = rt.timer.run_once(deadline.monotonic())
        assert due is not None and due <= deadline.monotonic() + 3.0 < lease.deadline
        assert not lease.lost
        rt.timer.run_once(due)
        assert lease.lost and "invoice-7" in lease.lost_reason and held.lost
        # The job's lease is given back once the store answers, so the job runs again
        assert rt.give_back_lost() == 1
    assert store.get("job-1").status == "pending"


def test_the_timer_thread_interrupts_a_body_whose_lock_passed_its_deadline(store):
    rt = Runtime(store, "host", default_interval=0.2, worker="host:5")
    lease = claim(store, rt, "job-1", duration=30.0, lease_heartbeat_interval=0.3)
    rt.heartbeat.start = lambda: None  # no renewals: only the deadlines speak
    caught: list[tuple[BaseException, float]] = []
    held: list[ResourceLock] = []

    def body() -> None:
        try:
            with lease.body(), lock(lease, "invoice-7", ttl=1.0) as lk:
                held.append(lk)
                end = time.monotonic() + 10
                while time.monotonic() < end:
                    sum(range(100))
        except LeaseLost as exc:
            caught.append((exc, deadline.monotonic()))

    worker = threading.Thread(target=body)
    try:
        rt.attach(Request(), lease)
        worker.start()
        worker.join(10)
    finally:
        rt.stop()
    [(exc, at)] = caught
    assert "invoice-7" in str(exc)
    assert held[0].deadline <= at < held[0].deadline + 2.0  # the timer, not the loop's end


def test_threads_starting_the_runtime_at_once_start_one_heartbeat_and_one_timer(store, monkeypatch):
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible: widen every race
    rt = Runtime(store, "host", default_interval=0.2, worker="host:6")
    started: list[str] = []
    real_start = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        if thread.name.startswith("celery-lease-"):
            started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    barrier = threading.Barrier(32)

    def first_task() -> None:
        barrier.wait()
        rt.start()

    try:
        callers = [threading.Thread(target=first_task) for _ in range(32)]
        for caller in callers:
            real_start(caller)
        for caller in callers:
            caller.join(10)
    finally:
        sys.setswitchinterval(previous)
        rt.stop()
    assert sorted(started) == ["celery-lease-deadline", "celery-lease-heartbeat"]


def test_a_delivery_reads_its_store_and_terms_once_until_the_settings_are_reloaded(tmp_path):
    import celery_lease.store as stores
    from celery_lease.app_state import app_state

    app = Celery("rt_deliveries", set_as_current=False)
    app.conf.update(lease_store_url=f"sqlite:///{tmp_path / 'store.db'}", lease_duration=30.0)

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.task")
    def task(self):  # pragma: no cover - never called
        return None

    stores.for_app(app, check=False).migrate()
    task.push_request(id="job-1", hostname="host")
    try:
        rt, store, policy, terms = runtime.for_delivery(task, "q")
        assert terms.duration == 30.0
        again = runtime.for_delivery(task, "q")
        assert again[0] is rt and again[1] is store and again[2] is policy and again[3] is terms
        assert runtime.for_delivery(task, "q", nesting=1)[3].nesting == 1
        rt.start = lambda: None
        rt.attach(Request(), claim(store, rt, "held"))  # a runtime holding a lease outlives the reload
        # What Django's setting_changed receiver does (contrib/django/reload.py): a reload.
        app.conf.lease_duration = 60.0
        app_state(app).config = None
        task.__dict__.pop("_lease_policies", None)
        stores.forget(app)
        rt2, store2, _, terms2 = runtime.for_delivery(task, "q")
        assert rt2 is rt and terms2.duration == 60.0
        assert store2 is not store and store2 is stores.for_app(app)
    finally:
        task.pop_request()
        for lease in rt.leases():
            rt.forget(lease)
        runtime.retire(app)


def test_a_lease_lost_locally_and_not_yet_given_back_is_given_back_at_shutdown(store, rt):
    # The outage outlasted the lease: the body got LeaseLost and its delivery is acked. The store answers
    # again, and the worker stops before any heartbeat round: the shutdown gives the job back, or it would
    # stay running under a dead worker until the reaper counts an expiration against it.
    lease = claim(store, rt, "job-1")
    rt.attach(Request(), lease)
    rt.lost_locally(lease, give_back=True)
    rt.detach(Request(), lease)
    rt.release_all()
    job = store.get("job-1")
    assert (job.status, job.locked_by, job.expired_count) == ("pending", None, 0)
    assert "released_after_local_loss" in [e["event"] for e in store.reports.events("job-1")]


def test_a_lost_lease_whose_release_landed_unanswered_is_given_back_once_the_store_answers(store, rt):
    # The release committed but its answer was lost: the next round finds the release its own token
    # wrote and counts the job given back (its message re-sent), neither a lease that moved on nor a
    # second, stale, release.
    lease = claim(store, rt, "job-1")
    rt.attach(Request(), lease)
    real, tries = store.jobs.release, []

    def answer_lost(*args, **kwargs):
        tries.append(real(*args, **kwargs))
        if len(tries) == 1:
            raise StoreUnavailable("connection dropped before the answer")
        return tries[-1]

    store.jobs.release = answer_lost
    rt.lost_locally(lease, give_back=True)
    assert rt.give_back_lost() == 0  # the store did not answer
    assert rt.give_back_lost() == 1
    assert tries == [True] and store.get("job-1").status == "pending"
    assert "stale_release_rejected" not in [e["event"] for e in store.reports.events("job-1")]
