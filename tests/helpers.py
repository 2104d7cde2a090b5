"""Helpers shared by the tests. Tests wait on something observable, never on a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

__all__ = ["wait_for", "with_password"]

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


def with_password(url: str, password: str = "s3cret") -> tuple[str, str]:
    """``url`` with a password in it, and that password: the one it has, or ``password`` added.

    The test servers trust local connections, so an added password still connects; a page
    or a message that quoted the URL would show it.
    """
    parts = urlsplit(url)
    if parts.password:
        return url, parts.password
    user = parts.username or "postgres"
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}"
                                            + (f":{parts.port}" if parts.port else ""))), password
