"""How operators read times and durations, shared by the CLI and the page (which must not import click)."""

from __future__ import annotations

import datetime
import re
from typing import Any

__all__ = ["one_line", "when", "age", "parse_duration"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def one_line(value: Any) -> str:
    """A table cell on one line: a multi-line text (a traceback, an error) folded with " | "."""
    text = "" if value is None else str(value)
    if "\n" not in text and "\r" not in text:
        return text
    return " | ".join(part.strip() for part in text.splitlines() if part.strip())


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
