"""How the pages write times and durations: the CLI's own formats (UTC to the millisecond, 12.3s, 5m03s)."""

from __future__ import annotations

import json
from typing import Any

from flask import Flask

from ..ops.formats import age, one_line, when

__all__ = ["register", "pretty_json"]


def pretty_json(text: str | None) -> str:
    """A stored JSON text indented for reading; text that is not JSON as it is."""
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text), indent=2, sort_keys=True, default=str)
    except ValueError:
        return text


def _ago(moment: float | None, now: float) -> str:
    """``12.3s ago`` / ``in 4.0s`` for a store time against the store's now."""
    if moment is None:
        return ""
    delta = now - moment
    return f"{age(delta)} ago" if delta >= 0 else f"in {age(-delta)}"


def register(web: Flask) -> None:
    filters: dict[str, Any] = {"age": age, "when": when, "ago": _ago, "one_line": one_line,
                               "pretty_json": pretty_json}
    web.jinja_env.filters.update(filters)
