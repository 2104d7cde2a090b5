"""The visibility extension: extenders, what a worker holds, the keeper's rounds and the bootstep.

Redis parts run against the real Redis (db 9) through kombu's own channel, and kombu's own
``restore_visible`` decides what comes back. The SQS extender runs against moto's SQS server
through kombu's SQS channel; its batching per queue is shown with a recording stand-in.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import SimpleNamespace

import kombu
import pytest
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker
from celery.utils.nodenames import gethostname
from celery.worker import state

from celery_lease import LeaseTask
from celery_lease.store import ClaimTerms, Store, for_app
from celery_lease.worker.brokers import (
    Held,
    RedisExtender,
    SQSExtender,
    VisibilityKeeper,
    VisibilityStep,
    extender_for,
    held_messages,
)
from tests.conftest import SQS_TRANSPORT_OPTIONS, prefixed_redis, unique_prefix
from tests.helpers import wait_for

REDIS_DB = 9


@pytest.fixture
def redis9(redis_url):
    """Redis db 9 and a key prefix of this test's own (kombu's global_keyprefix), removed after."""
    with prefixed_redis(redis_url, REDIS_DB) as handles:
        yield handles


@contextlib.contextmanager
def kombu_channel(url, **options):
    with kombu.Connection(url, transport_options=options) as connection:
        yield connection.default_channel


class Recorder:
    """An extender that records what it was asked to extend."""

    visibility_timeout = 2.0

    def __init__(self):
        self.calls = []

    def extend(self, held):
        self.calls.append(sorted(h.tag for h in held))
        return len(held)


# -- extenders ------------------------------------------------------------------
def test_redis_extender_moves_only_tags_still_unacked_under_the_prefixed_key_in_one_command(redis9):
    url, client, prefix = redis9
    with kombu_channel(url, global_keyprefix=prefix, unacked_index_key="my_index",
                       visibility_timeout=6) as channel:
        client.zadd(f"{prefix}my_index", {"t1": 1.0, "t2": 2.0})
        extender = extender_for(channel)
        assert isinstance(extender, RedisExtender) and extender.visibility_timeout == 6.0
        commands = []
        original = channel.conn_or_acquire

        @contextlib.contextmanager
        def counting(client=None):
            with original(client) as real:
                execute = real.execute_command
                real.execute_command = lambda *args, **kw: commands.append(args[0]) or execute(*args, **kw)
                yield real

        channel.conn_or_acquire = counting
        before = time.time()
        changed = extender.extend([Held("j1", "t1", {}), Held("j2", "t2", {}), Held("j3", "acked", {})])
    assert changed == 2 and commands == ["ZADD"]
    scores = dict(client.zrange(f"{prefix}my_index", 0, -1, withscores=True))
    assert set(scores) == {b"t1", b"t2"}  # XX: the acked tag is not resurrected
    assert all(score >= before for score in scores.values())
    assert not client.exists("my_index")  # the global key prefix was honoured


def test_a_refreshed_message_is_not_restored_by_kombu_and_an_unrefreshed_one_is(redis9):
    url, client, prefix = redis9
    index = f"{prefix}unacked_index"
    with kombu_channel(url, visibility_timeout=5, global_keyprefix=prefix) as channel:
        queue = kombu.Queue("vis", kombu.Exchange("vis"), "vis", channel=channel)
        queue.declare()
        kombu.Producer(channel).publish({"n": 1}, exchange="vis", routing_key="vis")
        message = queue.get(no_ack=False)  # now unacknowledged: scored in unacked_index
        tag = message.delivery_tag
        keeper = VisibilityKeeper(None, lambda: extender_for(channel),
                                  collect=lambda: [Held("job", tag, message.delivery_info)])

        client.zadd(index, {tag: time.time() - 60})  # held for a minute already
        assert keeper.run_once().extended == 1
        channel.qos.restore_visible(num=10, interval=1)
        assert client.llen(f"{prefix}vis") == 0 and client.zscore(index, tag) is not None

        keeper.collect = list  # the worker no longer holds it (or died)
        client.zadd(index, {tag: time.time() - 60})
        assert keeper.run_once().extended == 0
        channel.qos.restore_visible(num=10, interval=1)
        assert client.llen(f"{prefix}vis") == 1 and client.zscore(index, tag) is None


class FakeSQSChannel:
    """Records ChangeMessageVisibilityBatch calls the way kombu's SQS channel would route them."""

    visibility_timeout = 1800

    def __init__(self, fail_ids=(), fail_urls=()):
        self.calls = []
        self.fail_ids = set(fail_ids)
        self.fail_urls = set(fail_urls)

    def canonical_queue_name(self, name):
        return name.replace(".", "-")

    def sqs(self, queue=None):
        channel = self

        class Client:
            def change_message_visibility_batch(self, QueueUrl, Entries):  # noqa: N803 - boto3's names
                channel.calls.append((queue, QueueUrl, Entries))
                if QueueUrl in channel.fail_urls:
                    raise ConnectionError(f"{QueueUrl}: throttled")
                failed = [{"Id": e["Id"], "Code": "ReceiptHandleIsInvalid"} for e in Entries
                          if e["ReceiptHandle"] in channel.fail_ids]
                ok = [{"Id": e["Id"]} for e in Entries if e["ReceiptHandle"] not in channel.fail_ids]
                return {"Successful": ok, "Failed": failed}

        return Client()


def sqs_held(n, url="https://sqs/q1", routing_key="jobs.fast"):
    return Held(f"job{n}", f"rh{n}", {"sqs_message": {"ReceiptHandle": f"rh{n}"}, "sqs_queue": url,
                                      "routing_key": routing_key})


def test_sqs_extender_changes_visibility_in_batches_of_ten_per_queue(caplog, monkeypatch):
    # Another test's worker may have reconfigured logging: make sure this logger reaches caplog.
    logger = logging.getLogger("celery_lease.worker.brokers")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger="celery_lease.worker.brokers")
    channel = FakeSQSChannel(fail_ids={"rh3"})
    held = [sqs_held(n) for n in range(12)] + [sqs_held(99, url="https://sqs/q2", routing_key=None),
                                               Held("plain", "tag", {"routing_key": "jobs.fast"})]
    changed = SQSExtender(channel).extend(held)
    assert changed == 12  # 13 handles, one refused, the message without SQS metadata skipped
    assert [(q, url, len(entries)) for q, url, entries in channel.calls] == [
        ("jobs-fast", "https://sqs/q1", 10), ("jobs-fast", "https://sqs/q1", 2), (None, "https://sqs/q2", 1)]
    first = channel.calls[0][2][0]
    assert first == {"Id": "0", "ReceiptHandle": "rh0", "VisibilityTimeout": 1800}
    assert "ReceiptHandleIsInvalid" in caplog.text


def test_a_queue_whose_batch_fails_does_not_keep_the_other_queues_messages_from_being_extended():
    channel = FakeSQSChannel(fail_urls={"https://sqs/q1"})
    held = [sqs_held(1), sqs_held(2, url="https://sqs/q2", routing_key="jobs.slow")]
    with pytest.raises(ConnectionError, match="q1: throttled"):
        SQSExtender(channel).extend(held)  # the round still fails: the keeper reconnects, as before
    assert [url for _, url, _ in channel.calls] == ["https://sqs/q1", "https://sqs/q2"]


def test_sqs_extender_changes_held_messages_on_moto_and_reports_a_gone_one_once(sqs_url, caplog, monkeypatch):
    logger = logging.getLogger("celery_lease.worker.brokers")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger="celery_lease.worker.brokers")
    options = {**SQS_TRANSPORT_OPTIONS, "queue_name_prefix": unique_prefix().replace("_", "-"),
               "visibility_timeout": 30, "wait_time_seconds": 0}
    with kombu.Connection(sqs_url, transport_options=options) as conn:
        channel = conn.default_channel
        queue = kombu.Queue("vis.jobs", kombu.Exchange("vis.jobs"), routing_key="vis.jobs")(channel)
        queue.declare()
        for n in range(2):
            kombu.Producer(channel).publish({"n": n}, exchange="vis.jobs", routing_key="vis.jobs")
        kept, gone = queue.get(no_ack=False), queue.get(no_ack=False)
        assert queue.get(no_ack=False) is None  # both hidden for the queue's 30 s
        extender = extender_for(channel)
        assert isinstance(extender, SQSExtender)
        held = [Held(name, m.delivery_tag, m.delivery_info) for name, m in (("kept", kept), ("gone", gone))]
        assert extender.extend(held) == 2
        # Deleted through its receipt, as an ack of a worker that held an older receipt does.
        channel.sqs().delete_message(QueueUrl=gone.delivery_info["sqs_queue"],
                                     ReceiptHandle=gone.delivery_info["sqs_message"]["ReceiptHandle"])
        assert [extender.extend(held) for _ in range(3)] == [1, 1, 1]
        assert caplog.text.count("SQS refused to extend") == 1
        # The change reaches the message itself: visible again at once with a timeout of 0.
        extender.visibility_timeout = 0
        assert extender.extend(held[:1]) == 1
        again = queue.get(no_ack=False)
        assert again is not None and again.payload == kept.payload
        for message in (kept, gone, again):  # nothing left for kombu to restore on close
            message.ack()


def test_extender_for_picks_the_transport_and_ignores_those_without_a_visibility_timeout(redis9):
    with kombu.Connection("memory://") as memory:
        assert extender_for(memory.default_channel) is None
    with kombu_channel(redis9[0], ack_emulation=False) as channel:
        assert extender_for(channel) is None  # no ack emulation: no unacked index to refresh
    sqs = SimpleNamespace(connection=SimpleNamespace(driver_type="sqs"), visibility_timeout=30)
    assert isinstance(extender_for(sqs), SQSExtender)


# -- what a worker holds ---------------------------------------------------------
def make_app(broker="memory://", **conf):
    app = Celery(f"brokers_{unique_prefix()}", broker=broker, set_as_current=False)
    app.conf.update({"lease_store_url": "sqlite://", "lease_duration": 3.0, "lease_heartbeat_interval": 1.0,
                     **conf})

    @app.task(base=LeaseTask, shared=False, name="b.leased")
    def leased():
        return 1

    @app.task(shared=False, name="b.plain")
    def plain():
        return 1

    return app


class FakeRequest:
    def __init__(self, task, job_id, tag, acked=False, pid=None):
        self.task, self.id, self.hostname, self.worker_pid = task, job_id, "w1@host", pid
        self.message = SimpleNamespace(delivery_tag=tag, acknowledged=acked,
                                       delivery_info={"routing_key": "celery"})


@pytest.fixture
def worker_state():
    if not hasattr(state, "scheduled_requests"):
        pytest.skip("needs Celery 5.7 (celery.worker.state.scheduled_requests)")
    sets = (state.active_requests, state.reserved_requests, state.scheduled_requests)
    yield sets
    for requests in sets:
        requests.clear()


def test_held_messages_are_waiting_ones_and_running_unacked_leased_ones(worker_state):
    app = make_app()
    leased, plain = app.tasks["b.leased"], app.tasks["b.plain"]
    active, reserved, scheduled = worker_state
    requests = {
        "waiting": FakeRequest(plain, "j-wait", "t-wait"),
        "eta": FakeRequest(leased, "j-eta", "t-eta"),
        "running": FakeRequest(leased, "j-run", "t-run", pid=42),
        "running_plain": FakeRequest(plain, "j-plain", "t-plain", pid=42),
        "running_acked": FakeRequest(leased, "j-acked", "t-acked", acked=True, pid=42),
        "not_accepted": FakeRequest(leased, "j-new", "t-new"),
    }
    reserved.update([requests["waiting"], requests["running"], requests["running_plain"],
                     requests["running_acked"], requests["not_accepted"]])
    scheduled.add(requests["eta"])
    active.update([requests["running"], requests["running_plain"], requests["running_acked"]])
    held = {h.tag: h for h in held_messages()}
    assert set(held) == {"t-wait", "t-eta", "t-run", "t-new"}
    assert held["t-run"] == Held("j-run", "t-run", {"routing_key": "celery"}, leased=True,
                                 owners=("w1@host:42", f"{gethostname()}:42"), duration=3.0)
    assert not held["t-wait"].leased and not held["t-eta"].leased and not held["t-new"].leased


# -- the keeper's rounds ----------------------------------------------------------------
@pytest.fixture
def leases(store):
    """Jobs in the store: one healthy lease of w1@host:42, one held by another worker, one expired."""
    def claim(job_id, worker, duration):
        store.publishes.record(job_id, "b.leased", "celery", None, 5)
        assert store.jobs.claim(job_id, worker, f"tok-{job_id}",
                                ClaimTerms(duration=duration, grace=0.0,
                                           max_attempts=5, max_expirations=5, takeover=False),
                                task_name="b.leased", queue="celery", payload=lambda: None).claimed

    claim("healthy", "w1@host:42", 60.0)
    claim("stolen", "w9@elsewhere:7", 60.0)
    claim("expired", "w1@host:42", 0.0)
    return store


def leased(job_id, duration=60.0):
    return Held(job_id, f"t-{job_id}", {}, leased=True, owners=("w1@host:42",), duration=duration)


def test_a_round_extends_waiting_messages_and_healthy_leases_only(leases):
    recorder = Recorder()
    held = [Held("waiting", "t-waiting", {}), leased("healthy"), leased("stolen"), leased("expired"),
            leased("unknown")]
    keeper = VisibilityKeeper(None, lambda: recorder, collect=lambda: held, store=leases)
    result = keeper.run_once()
    assert recorder.calls == [["t-healthy", "t-waiting"]]
    assert (result.held, result.leased, result.not_healthy, result.extended) == (5, 4, 3, 2)
    assert keeper.interval == pytest.approx(0.5)  # a quarter of the visibility timeout


def test_while_the_store_is_down_a_lease_seen_healthy_is_trusted_for_its_duration(leases):
    recorder = Recorder()
    # Built before the first round: building it loads a driver, which on a busy machine can
    # take longer than a short lease and would end the trust before the outage round runs.
    unreachable = Store("postgresql+psycopg://postgres@127.0.0.1:1/nowhere", unique_prefix())
    held = [leased("healthy", duration=2.0)]
    keeper = VisibilityKeeper(None, lambda: recorder, collect=lambda: held, store=leases)
    keeper.run_once()
    keeper.store = unreachable
    keeper.run_once()
    assert recorder.calls == [["t-healthy"], ["t-healthy"]]
    wait_for(lambda: keeper.run_once().extended == 0, timeout=10, message="outage trust never ended")


def test_a_store_that_holds_the_read_costs_a_round_the_lease_call_bound_not_the_operators_one(postgres_url):
    """The visibility timeout may be short (SQS's is 30 s by default): a round whose store read waited the
    5-minute bound of operators' reads would let the broker hand a running job's message out again. The
    read gets the lease-call bound, and the round goes on trusting leases seen healthy."""
    import sqlalchemy as sa

    store = Store(postgres_url, unique_prefix(), call_timeout=1.0)
    store.migrate()
    recorder = Recorder()
    store.publishes.record("held", "b.leased", "celery", None, 5)
    terms = ClaimTerms(duration=60.0, grace=0.0, max_attempts=5, max_expirations=5, takeover=False)
    assert store.jobs.claim("held", "w1@host:42", "tok-held", terms, task_name="b.leased", queue="celery",
                            payload=lambda: None).claimed
    keeper = VisibilityKeeper(None, lambda: recorder, collect=lambda: [leased("held")], store=store)
    keeper.run_once()  # seen healthy once
    locker = sa.create_engine(postgres_url)
    rounds: list[int] = []
    try:
        with locker.connect() as other, other.begin():
            other.execute(sa.text(f'LOCK TABLE "{store.t.jobs.name}" IN ACCESS EXCLUSIVE MODE'))
            runner = threading.Thread(target=lambda: rounds.append(keeper.run_once().extended), daemon=True)
            runner.start()
            # The lock is held until the round is over or this wait gives up, far short of 5 minutes.
            runner.join(60)
            assert rounds == [1], "the round waited on the store past the lease-call bound"
        assert recorder.calls == [["t-held"], ["t-held"]]
    finally:
        locker.dispose()
        store.t.metadata.drop_all(store.engine)
        store.engine.dispose()


def test_the_keeper_loop_reconnects_after_a_failed_round_and_stops():
    recorder, connects = Recorder(), []

    def connect():
        connects.append(1)
        if len(connects) == 1:
            raise ConnectionError("broker down")
        return recorder

    keeper = VisibilityKeeper(None, connect, collect=lambda: [Held("j", "t", {})])
    keeper.visibility_timeout = 0.2  # retry quickly
    keeper.start()
    wait_for(lambda: len(recorder.calls) >= 2, timeout=5, message="keeper never recovered")
    keeper.stop()
    assert keeper.extender is None and len(connects) == 2
    assert not any(t.name == "celery-lease-visibility" for t in threading.enumerate())


# -- the bootstep -------------------------------------------------------------------------
def test_the_step_is_included_only_for_redis_or_sqs_with_the_setting_on(redis9):
    def included(app):
        return VisibilityStep(SimpleNamespace(app=app)).include_if(SimpleNamespace(app=app))

    assert included(make_app(redis9[0])) is True
    assert included(make_app(redis9[0], lease_extend_visibility=False)) is False
    assert included(make_app("memory://")) is False


def test_a_worker_keeps_a_job_longer_than_the_visibility_timeout_from_being_redelivered(redis9, tmp_path):
    url, client, prefix = redis9
    app = make_app(url, lease_store_url=f"sqlite:///{tmp_path / 'lease.sqlite3'}", task_acks_late=True,
                   # A lease far above the visibility timeout: its store calls (bounded by a third
                   # of it) then tolerate a slow disk, and only the visibility is under test.
                   worker_hijack_root_logger=False, lease_duration=6.0, lease_heartbeat_interval=1.0,
                   broker_transport_options={"visibility_timeout": 1, "unacked_restore_interval": 0.2,
                                             "unacked_restore_throttle": 1, "global_keyprefix": prefix})

    @app.task(base=LeaseTask, bind=True, shared=False, name="b.slow")
    def slow(self):
        threading.Event().wait(2.5)  # the job's work
        return self.request.delivery_info.get("redelivered", False)

    deliveries = []

    def received(request=None, **_):
        deliveries.append(request.delivery_info.get("redelivered"))

    signals.task_received.connect(received)
    try:
        for_app(app, check=False).migrate()
        result = slow.apply_async()
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            wait_for(lambda: any(t.name == "celery-lease-visibility" for t in threading.enumerate()),
                     timeout=5, message="the visibility step did not start")
            wait_for(lambda: (job := for_app(app).get(result.id)) and job.status == "completed",
                     timeout=15, message="job did not complete")
            wait_for(lambda: client.zcard(f"{prefix}unacked_index") == 0, timeout=5, message="not acked")
    finally:
        signals.task_received.disconnect(received)
    assert deliveries == [False]  # 2.5x the visibility timeout, never restored
    wait_for(lambda: not any(t.name == "celery-lease-visibility" for t in threading.enumerate()),
             timeout=5, message="the visibility step outlived its worker")
