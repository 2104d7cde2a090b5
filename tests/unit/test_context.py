"""The package's context variables: all in celery_lease.context, each thread with its own values."""

from __future__ import annotations

import contextvars
import re
import threading
from pathlib import Path

import celery_lease
import celery_lease.context as context

ROOT = Path(celery_lease.__file__).resolve().parent


def test_no_module_but_context_defines_a_context_variable() -> None:
    defining = sorted(str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
                      if re.search(r"\bContextVar\(", path.read_text(encoding="utf-8")))
    assert defining == ["context.py"]


def test_every_context_variable_is_named_for_the_package_and_listed() -> None:
    found = {name for name, value in vars(context).items() if isinstance(value, contextvars.ContextVar)}
    assert found == set(context.__all__)
    assert all(getattr(context, name).name.startswith("celery_lease_") for name in found)


def test_a_value_set_in_one_thread_is_not_seen_in_another() -> None:
    token = context.RESUMED.set("job-1")
    try:
        seen: list[str | None] = []
        other = threading.Thread(target=lambda: seen.append(context.RESUMED.get()))
        other.start()
        other.join(5)
        assert seen == [None] and context.RESUMED.get() == "job-1"
    finally:
        context.RESUMED.reset(token)
