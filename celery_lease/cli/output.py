"""How `celery lease` prints: aligned tables for people, JSON for machines, a progress bar on a TTY."""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import click

from ..masking import mask_secrets

__all__ = ["table", "emit_json", "echo", "with_app", "one_line", "when", "age", "parse_duration", "progress",
           "is_tty", "Duration"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
# A command in a hint: `celery lease jobs`, `celery -A proj lease migrate`.
_HINT = re.compile(r"\bcelery (?:-A \S+ )?lease\b")


def with_app(text: str, app: str | None) -> str:
    """``text`` whose command hints name the ``-A`` value given (``celery -A shop lease migrate``)."""
    if not app:
        return text
    return _HINT.sub(f"celery -A {app} lease", text)


def echo(text: str = "", nl: bool = True) -> None:
    """Print a command's output: hints name the app given with -A, passwords never show."""
    from .base import app_argument

    click.echo(with_app(mask_secrets(text), app_argument()), nl=nl)


def one_line(value: Any) -> str:
    """A table cell on one line: a multi-line text (a traceback, an error) folded with " | "."""
    text = "" if value is None else str(value)
    if "\n" not in text and "\r" not in text:
        return text
    return " | ".join(part.strip() for part in text.splitlines() if part.strip())


def is_tty() -> bool:
    """Whether stdout is a terminal (the progress bar's condition; a seam for tests)."""
    return sys.stdout.isatty()


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], empty: str = "(none)") -> str:
    """Rows as an aligned text table; ``columns`` are (key, header) pairs."""
    if not rows:
        return empty
    cells = [[header for _, header in columns]]
    cells += [[one_line(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit_json(data: Any) -> None:
    """``data`` as indented JSON on stdout."""
    echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def when(epoch: float | None) -> str | None:
    """A store time (epoch seconds) as UTC ISO 8601 to the millisecond."""
    if epoch is None:
        return None
    moment = datetime.datetime.fromtimestamp(epoch, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def age(seconds: float | None) -> str | None:
    """A duration for people: 0.4s, 12.3s, 5m03s, 2h04m, 3d02h; negative means in the future."""
    if seconds is None:
        return None
    sign, s = ("-" if seconds < 0 else ""), abs(seconds)
    if s < 60:
        return f"{sign}{s:.1f}s"
    if s < 3600:
        return f"{sign}{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{sign}{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{sign}{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '2h', '1d' -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration; write e.g. 30s, 10m, 2h or 1d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


class Duration(click.ParamType):
    """A click parameter type for durations like 10m."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@contextlib.contextmanager
def progress(items: Sequence[Any], label: str, enabled: bool) -> Iterator[Iterable[Any]]:
    """``click.progressbar`` over ``items`` when enabled (a terminal, not --json), else the items."""
    if not enabled or not items:
        yield items
        return
    with click.progressbar(items, label=label, file=sys.stderr, show_pos=True) as bar:
        yield bar
