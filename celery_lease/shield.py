"""The body's shield: library code that a lost lease's interruption waits for (core, so the store needs
nothing of the worker)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .context import BODY

__all__ = ["BODY", "uninterrupted"]


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Library code a lost lease's interruption waits for: it lands, if due, when the code ends."""
    lease = BODY.get()
    if lease is None:
        yield
        return
    with lease.shielded():
        yield
