"""Shared set-up of the one-live-owner tests: Redis db 13 (broker, results, reports), PostgreSQL store.

db 13 is never flushed: each test gets a queue and a key prefix of its own, removed afterwards.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import redis

from celery_lease.store import Store
from tests.apps.owner_app import make_app
from tests.conftest import unique_prefix
from tests.tcp_proxy import TcpProxy

REDIS_DB = 13
APP = "tests.apps.owner_app"


class OwnerEnv:
    """One test's broker, store, reports and the environment its worker subprocesses get."""

    def __init__(self, redis_url: str, postgres_url: str) -> None:
        self.broker_url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
        self.reports = redis.Redis.from_url(self.broker_url, decode_responses=True)
        self.prefix = unique_prefix()
        self.queue = f"own-{self.prefix}"
        self.postgres_url = postgres_url
        self.store = Store(postgres_url, self.prefix)
        self.store.migrate()
        self.proxies: list[TcpProxy] = []

    def env(self, store_url: str | None = None, **conf: Any) -> dict[str, str]:
        """The subprocess environment: this test's queue, store URL and extra settings."""
        return {"OWNER_BROKER": self.broker_url, "OWNER_STORE": store_url or self.postgres_url,
                "OWNER_PREFIX": self.prefix,
                "OWNER_CONF": json.dumps({"task_default_queue": self.queue, **conf})}

    def app(self, **conf: Any):
        """The test process's twin of the workers' app, reaching PostgreSQL directly."""
        return make_app(self.env(**conf))

    def proxied_store(self) -> tuple[TcpProxy, str]:
        """A proxy in front of PostgreSQL and the store URL that goes through it."""
        pg = urlsplit(self.postgres_url)
        proxy = TcpProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start()
        self.proxies.append(proxy)
        return proxy, self.postgres_url.replace(pg.netloc, f"{pg.username}@127.0.0.1:{proxy.port}")

    # -- reports --------------------------------------------------------------
    def started(self, job_id: str) -> list[tuple[int, int, float]]:
        rows = self.reports.lrange(f"{self.prefix}:{job_id}:started", 0, -1)
        return [(int(a), int(p), float(t)) for a, p, t in (row.split(":") for row in rows)]

    def checked(self, job_id: str, attempt: int) -> float | None:
        value = self.reports.get(f"{self.prefix}:{job_id}:checked:{attempt}")
        return float(value) if value else None

    def lost(self, job_id: str, attempt: int) -> tuple[float, str] | None:
        value = self.reports.get(f"{self.prefix}:{job_id}:lost:{attempt}")
        if not value:
            return None
        at, reason = value.split(":", 1)
        return float(at), reason

    def errbacks(self, job_id: str) -> int:
        return int(self.reports.get(f"{self.prefix}:{job_id}:errback") or 0)

    def release_held_slots(self) -> None:
        self.reports.set(f"{self.prefix}:go", 1)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.cut()
        self.store.t.metadata.drop_all(self.store.engine)
        self.store.engine.dispose()
        for pattern in (f"{self.prefix}:*", f"*{self.queue}*"):
            for key in self.reports.scan_iter(pattern):
                self.reports.delete(key)
        self.reports.close()
