"""The suite's worker apps. ``TESTS_GROUP_COMMIT=1`` runs every worker they start with
lease_group_commit on (unless its test sets it), so that the chaos, crash and integration suites
can be run with batching."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery.signals import celeryd_init, worker_ready

if os.environ.get("TESTS_GROUP_COMMIT") == "1":
    @celeryd_init.connect(weak=False)
    def _group_commit(conf: Any, **_: object) -> None:
        if "lease_group_commit" not in conf:
            conf.lease_group_commit = True

    @worker_ready.connect(weak=False)
    def _say_so(sender: Any, **_: object) -> None:
        import celery_lease.store as stores

        store = stores.for_app(sender.app)
        logging.getLogger(__name__).warning("TESTS_GROUP_COMMIT: completions by %s, records by %s",
                                            type(store.jobs).__name__, type(store.publishes).__name__)
