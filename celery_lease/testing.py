"""Helpers for the tests of apps that use LeaseTask: outside a worker, effect keys and checkpoints
are kept in this process, and ``local_leases(app)`` starts a test from nothing and shows them."""

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
