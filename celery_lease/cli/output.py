"""How `celery lease` prints: aligned tables for people, JSON for machines, a progress bar on a TTY."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import click

from ..masking import mask_secrets
from ..ops.formats import age, one_line, parse_duration, when

__all__ = ["table", "emit_json", "echo", "with_app", "app_argument", "one_line", "when", "age",
           "parse_duration", "progress", "is_tty", "Duration"]

_HINT = re.compile(r"\bcelery (?:-A \S+ )?lease\b")


def with_app(text: str, app: str | None) -> str:
    """``text`` whose command hints name the ``-A`` value given (``celery -A shop lease migrate``)."""
    if not app:
        return text
    return _HINT.sub(f"celery -A {app} lease", text)


def app_argument(ctx: click.Context | None = None) -> str | None:
    """The ``-A`` value the command was given (also from CELERY_APP), or None."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:
        return None
    value = ctx.find_root().params.get("app")
    if value is None or isinstance(value, str):
        return value
    # Older Celery (5.3) converts -A to the app object: find the text on the command line.
    return _argv_app(sys.argv[1:]) or os.environ.get("CELERY_APP") or getattr(value, "main", None) or "proj"


def _argv_app(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg in ("-A", "--app") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--app="):
            return arg[len("--app="):]
        if arg.startswith("-A") and len(arg) > 2:
            return arg[2:]
    return None


def echo(text: str = "", nl: bool = True) -> None:
    """Print a command's output: hints name the app given with -A, passwords never show."""
    click.echo(with_app(mask_secrets(text), app_argument()), nl=nl)


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
    echo(json.dumps(data, indent=2, sort_keys=True, default=str))


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
