"""Chaos on the path to the store (Redis db 13, PostgreSQL): a kernel dropping every packet, a slow store.

The black hole: one worker runs in a network namespace of its own and reaches PostgreSQL and
Redis through two veth pairs in private /30s (10.203.<n>.0/30 for the store, .4/30 for the
broker) and forwarders in the host namespace. Blackhole routes on both ends of the store
pair make both kernels drop every packet silently: nothing answers, nothing is acknowledged,
nothing is refused. The slow store: a transaction holds the jobs table in ACCESS EXCLUSIVE
mode (or every row of it FOR UPDATE) longer than one call's bound while a threads pool of 32
runs more tasks than the store's connection pool holds. Fast settings: 2 s leases, 0.4 s
heartbeats, 0.5 s grace (tests/apps/owner_app.py), so a call is bounded at 2/3 s.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import time
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from celery.result import AsyncResult

from tests.helpers import client_store, wait_for
from tests.owner_env import APP, OwnerEnv
from tests.reaper_env import reaper_loop
from tests.tcp_proxy import TcpProxy
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

LEASE, INTERVAL = 2.0, 0.4
CALL_BOUND = LEASE / 3
SLACK = 1.0  # a loaded two-core machine: scheduling, logging, the reports' own round trips
HEARTBEAT_UNAVAILABLE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): WARNING/[^\]]*\] "
    r"heartbeat of \S+ could not reach the lease store: (.*)$",
    re.MULTILINE)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Namespace:
    """A network namespace joined to this one by a store link and a broker link (veth pairs)."""

    def __init__(self) -> None:
        n = os.getpid() % 250 + 1
        self.name = f"ltchaos{os.getpid()}"
        self.store_host, self.store_peer = f"10.203.{n}.1", f"10.203.{n}.2"
        self.broker_host, self.broker_peer = f"10.203.{n}.5", f"10.203.{n}.6"
        self.links = [(f"lts{n}h", f"lts{n}n", self.store_host, self.store_peer),
                      (f"ltb{n}h", f"ltb{n}n", self.broker_host, self.broker_peer)]
        self.cut_routes: list[tuple[str, ...]] = []

    def create(self) -> None:
        _ip("netns", "add", self.name)
        _ip("-n", self.name, "link", "set", "lo", "up")
        for host_dev, ns_dev, host_addr, ns_addr in self.links:
            _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev, "netns", self.name)
            _ip("addr", "add", f"{host_addr}/30", "dev", host_dev)
            _ip("link", "set", host_dev, "up")
            _ip("-n", self.name, "addr", "add", f"{ns_addr}/30", "dev", ns_dev)
            _ip("-n", self.name, "link", "set", ns_dev, "up")

    def exec_prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.name)

    def black_hole_store(self) -> None:
        """Drop every packet between the namespace and the store forwarder, in both kernels."""
        for route in (("-n", self.name, "route", "add", "blackhole", f"{self.store_host}/32"),
                      ("route", "add", "blackhole", f"{self.store_peer}/32")):
            _ip(*route)
            self.cut_routes.append(route)

    def remove(self) -> None:
        for route in self.cut_routes:
            if route[0] != "-n":  # the namespace's own routes go with it
                subprocess.run(["ip", "route", "del", *route[2:]], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # its veths go too
        for host_dev, *_ in self.links:
            subprocess.run(["ip", "link", "del", host_dev], capture_output=True)


@pytest.fixture
def netns():
    ns = Namespace()
    try:
        ns.create()
    except (OSError, RuntimeError) as exc:
        ns.remove()
        pytest.skip(f"cannot build a network namespace with veth pairs here (needs root and "
                    f"CAP_NET_ADMIN): {exc}")
    yield ns
    ns.remove()


def forwarded(ns: Namespace, url: str, host: str, oenv: OwnerEnv) -> str:
    """``url`` rewritten to reach its server through a forwarder bound to ``host``."""
    parts = urlsplit(url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 0, host=host).start()
    oenv.proxies.append(proxy)
    user = f"{parts.username}@" if parts.username else ""
    return url.replace(parts.netloc, f"{user}{host}:{proxy.port}")


def log_lines(text: str, pattern: re.Pattern[str]) -> list[tuple[float, str]]:
    """(wall time, message) of the log lines matching ``pattern`` (Celery logs local time, in ms)."""
    return [(datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), message)
            for stamp, message in pattern.findall(text)]


def test_a_worker_behind_a_kernel_black_hole_gives_up_its_store_calls_within_the_bound_and_its_job_moves_on(
        oenv, netns, tmp_path):
    app = oenv.app()
    env = oenv.env(store_url=forwarded(netns, oenv.postgres_url, netns.store_host, oenv))
    env["OWNER_BROKER"] = forwarded(netns, oenv.broker_url, netns.broker_host, oenv)
    with celery_processes(tmp_path) as procs:
        # Given a body checking its lease in a worker whose only way to the store is the veth link
        cutoff = worker(APP, env, tmp_path, pool="threads", name="cutoff", wrapper=netns.exec_prefix())
        procs.append(cutoff)
        job = app.tasks["owner.guarded"].delay(60.0)
        wait_for(lambda: oenv.checked(job.id, 1), timeout=30, message="attempt 1 never checked its lease")
        # When both kernels drop every packet on that link (the heartbeat's statement hangs unanswered)
        cut_at = time.time()
        netns.black_hole_store()
        procs.append(worker(APP, oenv.env(), tmp_path, pool="threads", name="rescuer"))
        with reaper_loop(app, interval=0.25):
            # Then the hung heartbeat gives up within one call's bound and says so
            [(gave_up, why), *_] = wait_for(
                lambda: [line for line in log_lines(cutoff.output(), HEARTBEAT_UNAVAILABLE)
                         if line[0] >= cut_at - 0.001],
                timeout=10, message="the cut-off worker never logged an unreachable store")
            lost_at, reason = wait_for(lambda: oenv.lost(job.id, 1), timeout=10,
                                       message="the cut-off body never saw LeaseLost")
            wait_for(lambda: len(oenv.started(job.id)) >= 2, timeout=30, message="the job was not taken over")
            [(_, _, started_again)] = [row for row in oenv.started(job.id) if row[0] == 2]
            last_pass = oenv.checked(job.id, 1)
            wait_for(lambda: oenv.store.get(job.id).status == "completed", timeout=20,
                     message="the second worker did not complete the job")
        oenv.release_held_slots()
    # A statement in flight hangs and is given up ("no answer from the server"); a connection
    # opened after the cut is refused at once by the namespace's own blackhole route (EINVAL):
    # either way the heartbeat names the store it could not reach, within one call's bound.
    assert f"{netns.store_host}:" in why and "unreachable" in why, why
    assert gave_up - cut_at < INTERVAL + CALL_BOUND + SLACK, (cut_at, gave_up)
    # and the body stopped trusting its lease on its own clock, before another worker started
    assert "local deadline passed" in reason
    assert lost_at - cut_at < LEASE + SLACK, (cut_at, lost_at)
    assert cut_at < last_pass < started_again, (cut_at, last_pass, started_again)


MET_SLOW_STORE = re.compile(r"could not reach the lease store|finished but the store is unreachable")


def final_state(app, job_id: str) -> str | None:
    """The job's Celery state in the result backend once it is SUCCESS or FAILURE."""
    state = AsyncResult(job_id, app=app).state
    return state if state in ("SUCCESS", "FAILURE") else None


@pytest.mark.parametrize("hold", ["table", "rows"])
def test_a_threads_pool_larger_than_the_connection_pool_rides_out_a_slow_store_without_failures(
        oenv, tmp_path, hold):
    app = oenv.app()
    client_store(app)  # this process publishes only; the worker keeps the app's bound
    jobs_table = oenv.store.t.jobs.name
    locker = sa.create_engine(oenv.postgres_url, poolclass=sa.pool.NullPool)
    with celery_processes(tmp_path) as procs:
        # Given a threads pool of 32 (the store's connection pool holds 10) with work under way
        w = worker(APP, oenv.env(), tmp_path, pool="threads", concurrency=32, name="threads32")
        procs.append(w)
        warm = app.tasks["owner.guarded"].delay(0.05)
        wait_for(lambda: oenv.store.get(warm.id) and oenv.store.get(warm.id).status == "completed",
                 timeout=30, message="the worker never completed a first job")
        jobs = [app.tasks["owner.guarded"].delay(0.3) for _ in range(48)]
        wait_for(lambda: sum(bool(oenv.started(j.id)) for j in jobs) >= 8, timeout=20,
                 message="the bodies never started")
        # When a transaction holds the jobs table (or every row in it) longer than a call's bound
        with locker.connect() as conn, conn.begin():
            conn.execute(sa.text(f'LOCK TABLE "{jobs_table}" IN ACCESS EXCLUSIVE MODE' if hold == "table"
                                 else f'SELECT 1 FROM "{jobs_table}" FOR UPDATE'))
            locked = time.monotonic()
            # held until the worker has met the slow store, and past one call's bound
            wait_for(lambda: MET_SLOW_STORE.search(w.output()) and time.monotonic() > locked + CALL_BOUND,
                     timeout=10, message="the worker never met the slow store")
        # Then once it is released every job completes, each body ran once, and none failed
        wait_for(lambda: all((row := oenv.store.get(j.id)) and row.status == "completed" for j in jobs),
                 timeout=60, message="not every job completed after the store recovered")
        states = {j.id: wait_for(lambda j=j: final_state(app, j.id), timeout=20,
                                 message="a job's result never became final") for j in jobs}
    locker.dispose()
    assert {state for state in states.values()} == {"SUCCESS"}, states
    assert {j.id: len(oenv.started(j.id)) for j in jobs} == {j.id: 1 for j in jobs}
