"""Duplicates, replacements and revokes that lose nothing and redo nothing, against real workers.

A Redis broker (db 13, shared; each test its own queue and key prefix; RabbitMQ, through a proxy the
test can cut, where the point needs a broker outage), a PostgreSQL store (reached through a proxy the
test can cut where the point needs an outage), real ``celery
worker`` subprocesses (tests/apps/post_run_safety_app.py).
"""

from __future__ import annotations

import re
import uuid
from urllib.parse import urlsplit

import pytest
import redis
from celery import chain

from celery_lease.messaging import messages
from celery_lease.reaper.run import Reaper
from celery_lease.store import Store
from tests.apps.post_run_safety_app import make_app
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.reaper_env import reap_round
from tests.tcp_proxy import TcpProxy
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_DB = 13
APP = "tests.apps.post_run_safety_app"


class Scene:
    """One test's queue, key prefix, store and the environment its workers get."""

    def __init__(self, redis_url: str, postgres_url: str) -> None:
        self.broker = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
        self.reports = redis.Redis.from_url(self.broker, decode_responses=True)
        self.prefix = unique_prefix()
        self.queue = f"safety-{uuid.uuid4().hex[:8]}"
        self.postgres_url = postgres_url
        self.store = Store(postgres_url, self.prefix)
        self.store.migrate()
        self.proxies: list[TcpProxy] = []
        self.apps: list = []

    def env(self, backend: str, store_url: str | None = None, broker: str | None = None) -> dict[str, str]:
        return {"SAFETY_BROKER": broker or self.broker, "SAFETY_REPORTS": self.broker,
                "SAFETY_BACKEND": backend, "SAFETY_STORE": store_url or self.postgres_url,
                "SAFETY_PREFIX": self.prefix, "SAFETY_QUEUE": self.queue}

    def app(self, backend: str, broker: str | None = None):
        """The test process's twin of the workers' app, reaching PostgreSQL (and the broker) directly."""
        app = make_app(self.env(backend, broker=broker))
        self.apps.append(app)
        return app

    def proxied_store(self) -> tuple[TcpProxy, str]:
        pg = urlsplit(self.postgres_url)
        proxy = TcpProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start()
        self.proxies.append(proxy)
        return proxy, self.postgres_url.replace(pg.netloc, f"{pg.username}@127.0.0.1:{proxy.port}")

    def proxied_broker(self, url: str) -> tuple[TcpProxy, str]:
        parts = urlsplit(url)
        proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672).start()
        self.proxies.append(proxy)
        netloc = parts.netloc.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
        return proxy, parts._replace(netloc=netloc).geturl()

    def events(self, job_id: str) -> list[str]:
        return [str(e["event"]) for e in self.store.reports.events(job_id)]

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.cut()
        for app in self.apps:
            app.close()
        self.store.drop_schema()
        self.store.engine.dispose()
        for key in self.reports.scan_iter(f"{self.prefix}*"):
            self.reports.delete(key)
        self.reports.delete(self.queue)
        self.reports.close()


@pytest.fixture
def scene(redis_url, postgres_url):
    scene = Scene(redis_url, postgres_url)
    yield scene
    scene.close()


def test_a_duplicate_of_a_completed_job_with_the_rpc_backend_does_not_run_its_callbacks_again(
        scene, tmp_path):
    # Given a job completed with the tutorial's rpc:// backend, its link callback run once.
    app = scene.app("rpc://")
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, scene.env("rpc://"), tmp_path, pool="threads", concurrency=2,
                            queues=scene.queue))
        result = app.tasks["safety.total"].apply_async((4,), link=app.tasks["safety.callback"].s())
        assert result.get(timeout=30) == 40
        job_id = result.id
        wait_for(lambda: scene.reports.get(f"{scene.prefix}:callback") == "1", timeout=20,
                 message="the link callback never ran")
        # When a duplicate of its message is delivered (the worker cannot read an rpc:// result).
        messages.republish(app, job_id, scene.store.get(job_id).payload)
        wait_for(lambda: {"duplicate_delivery_skipped", "post_run_resumed"} & set(scene.events(job_id)),
                 timeout=30, message="the duplicate was never delivered")
        # Then it is an ordinary skipped duplicate: no post-run work again, no callback again.
        events = scene.events(job_id)
        assert "post_run_resumed" not in events, events
        assert scene.reports.get(f"{scene.prefix}:callback") == "1"
        assert scene.reports.get(f"{scene.prefix}:runs:safety.total:{job_id}") == "1"


def scheduled_ids(app) -> set[str]:
    """The ids of the ETA tasks every worker on this broker holds."""
    replies = app.control.inspect(timeout=1.0).scheduled() or {}
    return {entry["request"]["id"] for entries in replies.values() for entry in entries}


def test_a_revoke_during_a_store_outage_cancels_the_job_once_the_store_answers(scene, tmp_path):
    proxy, store_url = scene.proxied_store()
    backend = scene.broker
    app = scene.app(backend)
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, scene.env(backend, store_url), tmp_path, pool="threads", concurrency=2,
                            queues=scene.queue))
        wait_for(lambda: " ready." in procs[0].output(), timeout=30, message="the worker never started")
        # Given a pending job whose message the worker holds until its ETA.
        result = app.tasks["safety.add"].apply_async((1, 2), countdown=10)
        job_id = result.id
        wait_for(lambda: job_id in scheduled_ids(app), timeout=30, interval=0.2,
                 message="the worker never received the job")
        # When it is revoked while the store is unreachable (the worker discards it at its ETA).
        proxy.cut()
        app.control.revoke(job_id)
        wait_for(lambda: result.state == "REVOKED", timeout=30, interval=0.1,
                 message="the worker never discarded the revoked job")
        # The worker's cancel has met the outage (it is logged: nothing else shows it).
        wait_for(lambda: re.search(r"unreachable|StoreUnavailable",
                                   procs[0].output().partition("Discarding revoked task")[2]),
                 timeout=30, interval=0.1, message="the worker's cancel never met the outage")
        assert scene.store.get(job_id).status == "pending"  # the store has not heard of it yet
        proxy.start()
        # Then the cancel reaches the store once it answers: the job never runs.
        job = wait_for(lambda: (j := scene.store.get(job_id)) is not None and j.status == "failed" and j,
                       timeout=20, interval=0.1, message="the revoke's cancel never reached the store")
    assert job.last_error == "revoked (revoked)"
    assert scene.reports.get(f"{scene.prefix}:runs:safety.add:{job_id}") is None


def test_a_chains_next_step_is_sent_when_the_broker_failed_after_the_body_returned(scene, tmp_path, amqp_url):
    # Given chain(gate(5), add(1)) on RabbitMQ, the gate acks_late, the worker reaching the broker through
    # a proxy, and the gate's body running
    backend = scene.broker
    proxy, proxied = scene.proxied_broker(amqp_url)
    app = scene.app(backend, broker=amqp_url)
    try:
        with celery_processes(tmp_path) as procs:
            procs.append(worker(APP, scene.env(backend, broker=proxied), tmp_path, concurrency=2,
                                queues=scene.queue))
            result = chain(app.tasks["safety.gate"].si(5), app.tasks["safety.add"].s(1)).apply_async()
            first = result.parent.id
            wait_for(lambda: scene.reports.get(f"{scene.prefix}:runs:safety.gate:{first}") == "1", timeout=30,
                     message="the gate never started")
            # When the broker goes away and the body returns: the job completes in the store, its next
            # step's publish and its ack fail (Celery stores FAILURE for the step it could not send)
            proxy.cut()
            scene.reports.rpush(f"{scene.prefix}:open:{first}", 1)
            wait_for(lambda: app.AsyncResult(first).state == "FAILURE", timeout=60,
                     message="the failed publish of the next step was never reported")
            assert scene.store.get(first).status == "completed"
            # ... and comes back: RabbitMQ delivers the unacknowledged message again
            proxy.start()
            # Then the chain goes on as with plain Celery: the gate's result stored, the next step run,
            # the gate's body once
            wait_for(lambda: app.AsyncResult(first).state == "SUCCESS", timeout=60,
                     message="the redelivered gate never finished its post-run work")
            # (Celery marked the chain's later steps FAILURE with the gate's failure, as without a lease:
            # the step's own run stores its result over it.)
            wait_for(lambda: app.AsyncResult(result.id).state == "SUCCESS", timeout=60,
                     message="the chain's next step never ran")
            assert app.AsyncResult(result.id).result == 6
        assert scene.reports.get(f"{scene.prefix}:runs:safety.gate:{first}") == "1"
        assert scene.reports.get(f"{scene.prefix}:runs:safety.add:{result.id}") == "1"
        assert scene.events(first).count("post_run_resumed") == 1
    finally:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(scene.queue)


def test_a_worker_killed_while_a_job_replaces_itself_with_a_chain_loses_nothing(scene, tmp_path):
    # Given a job that replaces itself with chain(add(1, 1), add(10)), acks_late off, and a
    # worker that dies just before it publishes the chain's first step.
    backend = scene.broker
    app = scene.app(backend)
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, {**scene.env(backend), "SAFETY_KILL_BEFORE_STEP": "1"}, tmp_path,
                            pool="threads", queues=scene.queue, name="dies"))
        result = app.tasks["safety.replacer"].delay(1)
        job_id = result.id
        wait_for(lambda: procs[0].popen.poll() is not None, timeout=30, message="the worker never died")
        assert scene.reports.get(f"{scene.prefix}:killed")
        # When another worker and the reaper take over.
        procs.append(worker(APP, scene.env(backend), tmp_path, pool="threads", queues=scene.queue,
                            name="heir"))
        reaper = Reaper(app)

        def finished() -> bool:
            reap_round(reaper)
            job = scene.store.get(job_id)
            return job is not None and job.status == "completed"

        # Then the job still ends: its chain ran and the carrier's result is the job's.
        wait_for(finished, timeout=40, interval=0.5, message="the replaced job was lost")
        assert result.get(timeout=20) == 12


def test_a_terminating_revoke_during_a_store_outage_cancels_the_running_job_once_the_store_answers(
        scene, tmp_path):
    proxy, store_url = scene.proxied_store()
    backend = scene.broker
    app = scene.app(backend)
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, scene.env(backend, store_url), tmp_path, pool="prefork",
                            queues=scene.queue))
        # Given a job running in a prefork child.
        result = app.tasks["safety.sleeper"].delay(30)
        job_id = result.id
        wait_for(lambda: scene.reports.get(f"{scene.prefix}:runs:safety.sleeper:{job_id}"), timeout=30,
                 message="the job never started")
        # When it is revoked with terminate=True while the store is unreachable.
        proxy.cut()
        app.control.revoke(job_id, terminate=True)
        # Celery stores REVOKED after the worker tried its cancel and signalled the child.
        wait_for(lambda: result.state == "REVOKED", timeout=30, interval=0.1,
                 message="the worker never terminated the run")
        assert scene.store.get(job_id).status == "running"  # the store has not heard of it yet
        proxy.start()
        reaper = Reaper(app)

        def settled():
            reap_round(reaper)
            job = scene.store.get(job_id)
            return job.status == "failed" and job

        # Then the cancel reaches the store once it answers: the job is not run again.
        job = wait_for(settled, timeout=20, interval=0.2, message="the terminating revoke's cancel was lost")
    # The terminating revoke's own cancel, not a later delivery the worker happened to still
    # know as revoked: the job never went back to its queue, so no worker can run it again.
    assert job.last_error == "revoked (terminated)"
    assert "requeued" not in scene.events(job_id), scene.events(job_id)
    assert scene.reports.get(f"{scene.prefix}:runs:safety.sleeper:{job_id}") == "1"
