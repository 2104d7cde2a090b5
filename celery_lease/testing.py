"""Helpers for the tests of apps that use LeaseTask.

Outside a worker (``task_always_eager``, ``apply()``, a direct call) ``self.lease`` is a
local handle whose effect keys and checkpoints are kept in this process, per app.
``local_leases(app)`` starts a test from nothing and shows what the runs did::

    @pytest.fixture
    def leases(celery_app):
        with local_leases(celery_app) as state:
            yield state

    def test_capture_is_charged_once(leases):
        capture_payment.apply(("p-1",))
        capture_payment.apply(("p-1",))
        assert list(leases.effects) == ["payment-captured:p-1"]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .worker.local import LocalState, state

__all__ = ["local_leases", "LocalState"]


@contextlib.contextmanager
def local_leases(app: Any) -> Iterator[LocalState]:
    """Fresh local effect keys, checkpoints and locks for ``app``; cleared again on exit."""
    current = state(app)
    current.clear()
    try:
        yield current
    finally:
        current.clear()
