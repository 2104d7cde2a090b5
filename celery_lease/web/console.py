"""The pages' Console, in a module of its own so that the pages can import it while ``app`` imports them."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..store import Store
from .security import Guard

__all__ = ["Console", "console"]


@dataclasses.dataclass(frozen=True)
class Console:
    """What every page works with: the Celery app, its store and what this server may do."""

    app: Any
    store: Store  # the store in both roles: its reports, and the reaper's view for the dry run
    guard: Guard
    allow_actions: bool
    show_arguments: bool


def console() -> Console:
    from flask import current_app

    found: Console = current_app.extensions["celery_lease"]
    return found
