"""outage.py: the pause of a worker's consumer while the store is unreachable, against a real
PostgreSQL behind a proxy the test cuts; the consumer is a stand-in whose event loop the test
drains (a real worker does this in tests/integration/test_outage_workers.py)."""

from __future__ import annotations

import queue
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery import Celery

from celery_lease.store import Store
from celery_lease.worker.outage import ConsumerPause, store_unreachable
from tests.helpers import wait_for
from tests.tcp_proxy import TcpProxy

PROBE = 0.05  # seconds between the probe's questions


class TaskConsumer:
    def __init__(self) -> None:
        self.consuming, self.cancels, self.consumes = True, 0, 0

    def cancel(self) -> None:
        self.consuming, self.cancels = False, self.cancels + 1

    def consume(self) -> None:
        self.consuming, self.consumes = True, self.consumes + 1


class Consumer:
    """Celery's consumer as the pause uses it: ``call_soon`` queues work for its event loop."""

    def __init__(self) -> None:
        self.task_consumer: TaskConsumer | None = TaskConsumer()
        self.loop: queue.Queue = queue.Queue()

    def call_soon(self, callback) -> None:
        self.loop.put(callback)

    def run_loop(self) -> int:
        """One turn of the event loop: run what was queued; returns how many callbacks ran."""
        ran = 0
        while not self.loop.empty():
            self.loop.get()()
            ran += 1
        return ran


@pytest.fixture
def proxied(postgres_url):
    pg = urlsplit(postgres_url)
    proxy = TcpProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start()
    store = Store(urlunsplit(pg._replace(netloc=f"{pg.username}@127.0.0.1:{proxy.port}")), "outage_")
    yield proxy, store
    proxy.cut()
    store.engine.dispose()


def test_a_report_stops_the_consumer_in_its_loop_and_the_store_answering_resumes_it(proxied):
    proxy, store = proxied
    pause, consumer = ConsumerPause(store, PROBE), Consumer()
    pause.bind(consumer)
    try:
        # Given a store that does not answer
        proxy.cut()
        # When deliveries report it, from any thread, twice
        pause.store_unreachable("lease store unreachable")
        pause.store_unreachable("lease store unreachable")
        # Then the consumer is cancelled once, in its own loop, not in the reporting thread
        assert consumer.task_consumer.consuming and pause.paused
        assert consumer.run_loop() == 1 and not consumer.task_consumer.consuming
        # When the store answers again, the probe tells the loop to consume again
        proxy.start()
        wait_for(lambda: not consumer.loop.empty(), timeout=5, message="the probe never saw the store answer")
        consumer.run_loop()
        assert consumer.task_consumer.consuming and not pause.paused
        assert (consumer.task_consumer.cancels, consumer.task_consumer.consumes) == (1, 1)
    finally:
        pause.stop()


def test_a_consumer_that_reconnects_while_the_store_is_down_is_stopped_again(proxied):
    proxy, store = proxied
    pause, consumer = ConsumerPause(store, PROBE), Consumer()
    pause.bind(consumer)
    try:
        proxy.cut()
        pause.store_unreachable("lease store unreachable")
        consumer.task_consumer = None  # the broker connection dropped before the loop ran
        consumer.run_loop()
        # When the consumer restarts with a new task consumer (which consumes from the start)
        consumer.task_consumer = TaskConsumer()
        pause.bind(consumer)
        consumer.run_loop()
        # Then it is cancelled too, until the store answers
        assert not consumer.task_consumer.consuming
        proxy.start()
        wait_for(lambda: consumer.run_loop() and consumer.task_consumer.consuming, timeout=5,
                 message="the consumer never resumed")
    finally:
        pause.stop()


def test_a_report_without_a_consumer_or_after_the_stop_changes_nothing(proxied):
    _, store = proxied
    unbound = ConsumerPause(store, PROBE)
    unbound.store_unreachable("lease store unreachable")  # a process that is no worker's main process
    assert not unbound.paused
    stopped, consumer = ConsumerPause(store, PROBE), Consumer()
    stopped.bind(consumer)
    stopped.stop()
    stopped.store_unreachable("lease store unreachable")  # a worker shutting down
    assert not stopped.paused and consumer.run_loop() == 0
    app = Celery("no_worker", set_as_current=False)
    store_unreachable(app, "lease store unreachable")  # no runtime in this process: nothing to pause
