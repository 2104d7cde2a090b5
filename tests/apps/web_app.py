"""The app a real worker and `celery lease web` run in the browser tests (tests/integration/test_web.py).

Configured from the environment: WEB_BROKER (a Redis URL), WEB_KEYPREFIX (kombu's global key
prefix, so the test's keys are its own), WEB_QUEUE, WEB_STORE and WEB_PREFIX. Fast leases: 2 s,
heartbeats every 0.4 s, workers stale after 2 s; no reaper runs, so a killed worker's job stays
expired for the page to show.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from celery import Celery

from celery_lease import LeaseTask

SETTINGS = dict(
    lease_duration=2.0, lease_heartbeat_interval=0.4, lease_grace_period=0.5, lease_worker_stale_after=2.0,
    lease_max_attempts=3, task_ignore_result=True, worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def make_app(env: Mapping[str, str]) -> Celery:
    """The app from an environment (the test process builds its twin to send jobs)."""
    app = Celery("web_app", broker=env.get("WEB_BROKER", "redis://127.0.0.1:6379/12"), set_as_current=False)
    app.conf.update(SETTINGS, lease_store_url=env.get("WEB_STORE", "sqlite:///web_app.sqlite3"),
                    lease_table_prefix=env.get("WEB_PREFIX", "web_"),
                    task_default_queue=env.get("WEB_QUEUE", "web"),
                    broker_transport_options={"global_keyprefix": env.get("WEB_KEYPREFIX", "")})

    @app.task(base=LeaseTask, name="shop.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(base=LeaseTask, name="shop.capture_payment", shared=False)
    def capture_payment(payment_id: str) -> None:
        raise ValueError(f"card declined for {payment_id}")

    @app.task(base=LeaseTask, name="shop.build_report", shared=False)
    def build_report(seconds: float) -> None:
        threading.Event().wait(seconds)

    return app


def __getattr__(name: str) -> Any:
    if name != "app":
        raise AttributeError(name)
    return make_app(os.environ)
