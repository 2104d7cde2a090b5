"""Helpers shared by the tests. Tests wait on something observable, never on a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for"]

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition not met",
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that value.

    Raises AssertionError naming ``message``, the timeout and the last value seen
    when the deadline passes first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (waited {timeout:g}s; last value: {value!r})")
        time.sleep(interval)
