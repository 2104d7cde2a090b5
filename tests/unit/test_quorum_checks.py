"""``lease check`` on RabbitMQ quorum queues (the real RabbitMQ: its version decides the default limit)."""

from __future__ import annotations

import uuid

import kombu
import pytest
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.ops.checks import run_checks
from celery_lease.ops.quorum_checks import server_major
from celery_lease.store import Store
from tests.conftest import unique_prefix


def noop(self) -> None:
    return None


def quorum_app(amqp_url: str, queue: str, limit: int | None, max_attempts: int = 5) -> Celery:
    arguments = {"x-queue-type": "quorum", **({"x-delivery-limit": limit} if limit is not None else {})}
    app = Celery(f"quorum_{unique_prefix()}", broker=amqp_url, set_as_current=False)
    app.conf.update(lease_store_url="sqlite://", task_acks_late=True, lease_max_attempts=max_attempts,
                    task_default_queue=queue,
                    task_queues=[kombu.Queue(queue, routing_key=queue, queue_arguments=arguments)])
    app.task(base=LeaseTask, bind=True, shared=False, name="q.work")(noop)
    return app


@pytest.fixture
def queue(amqp_url):
    name = f"lease-quorum-{uuid.uuid4().hex[:8]}"
    yield name
    with kombu.Connection(amqp_url) as connection:
        connection.default_channel.queue_delete(name)


@pytest.fixture
def findings(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'lease.sqlite3'}", unique_prefix())
    store.migrate()
    yield lambda app: [f for f in run_checks(app, store) if f.code == "quorum_delivery_limit"]
    store.engine.dispose()


def test_a_delivery_limit_below_lease_max_attempts_is_named_with_both_numbers(amqp_url, queue, findings):
    app = quorum_app(amqp_url, queue, limit=1, max_attempts=5)
    with app.connection_for_write() as connection:  # the real broker takes the queue as declared
        app.amqp.queues[queue].bind(connection.default_channel).declare()
    [finding] = findings(app)
    assert finding.level == "warning"
    assert finding.values == {"task": "q.work", "queue": queue, "x-delivery-limit": 1,
                              "source": "x-delivery-limit", "lease_max_attempts": 5}
    assert finding.fix == "declare the queue with x-delivery-limit >= 4, or lower lease_max_attempts to 2"


def test_a_delivery_limit_that_outlasts_the_attempts_is_ok(amqp_url, queue, findings):
    [finding] = findings(quorum_app(amqp_url, queue, limit=4, max_attempts=5))
    assert finding.level == "ok" and finding.values == {"delivery_limits": {queue: 4}}


def test_an_unset_limit_is_the_servers_default(amqp_url, queue, findings):
    major = server_major(quorum_app(amqp_url, queue, limit=None))
    assert major is not None
    [finding] = findings(quorum_app(amqp_url, queue, limit=None, max_attempts=30))
    # RabbitMQ 4 drops a message after 21 deliveries by default; RabbitMQ 3 never does.
    assert finding.level == ("warning" if major >= 4 else "ok")


def test_a_classic_queue_has_no_delivery_limit_finding(amqp_url, queue, findings):
    app = quorum_app(amqp_url, queue, limit=1)
    app.conf.task_queues = [kombu.Queue(queue, routing_key=queue)]
    assert findings(app) == []
