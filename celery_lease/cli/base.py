"""The `lease` command group, its error handling and what every verb shares.

Library errors leave as one line with an exit status per kind; only the command's output goes to stdout.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import click

from ..app_state import app_state
from ..errors import LeaseConfigError, LeaseError, StoreUnavailable
from ..masking import mask_secrets
from .output import app_argument, with_app

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["lease", "CommandError", "app_of", "store_of", "json_option", "app_argument",
           "NO_APP"]

EX_FAILURE, EX_UNAVAILABLE, EX_CONFIG = 1, 69, 78  # as celery.platforms / sysexits.h
NO_APP = "name your app: celery -A proj lease ... (the module or package that defines the Celery app)"


class CommandError(click.ClickException):
    """A `celery lease` failure: printed as ``Error: ...`` on stderr, with its exit status."""

    def __init__(self, message: str, exit_code: int = EX_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares a class default, read per instance


def _exit_code(exc: LeaseError) -> int:
    if isinstance(exc, StoreUnavailable):
        return EX_UNAVAILABLE
    if isinstance(exc, LeaseConfigError):
        return EX_CONFIG
    return EX_FAILURE


class LeaseGroup(click.Group):
    """Turns celery_lease errors raised by a verb into clean one-line command errors."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LeaseError as exc:
            message = with_app(mask_secrets(" ".join(str(exc).split())), app_argument(ctx))
            raise CommandError(message, _exit_code(exc)) from exc
        except click.ClickException as exc:
            message = with_app(mask_secrets(exc.message), app_argument(ctx))
            if message == exc.message:
                raise
            raise CommandError(message, exc.exit_code) from exc


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (click's test runner swaps it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def _log_to_stderr(verbose: int) -> None:
    """celery_lease's log records to stderr, never stdout; the logger's level is only lowered for -v,
    so that a host process keeps its own."""
    logger = logging.getLogger("celery_lease")
    handler = next((h for h in logger.handlers if isinstance(h, _Stderr)), None)
    if handler is None:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    handler.setLevel(level)
    if verbose:
        logger.setLevel(level)


@click.group(name="lease", cls=LeaseGroup)
@click.option("-v", "--verbose", count=True, help="Also log celery_lease's INFO (-vv: DEBUG) to stderr.")
@click.pass_context
def lease(ctx: click.Context, verbose: int = 0, **_: Any) -> None:
    """Leases, the reaper, dead letters and metrics of celery_lease jobs.

    The playbook for zombie jobs: confirm (status, inspect), scope (jobs, events),
    check the reaper before any manual recovery (reap --dry-run), recover in small
    batches (requeue, dlq redrive), then retune (tune, check).
    """
    if getattr(ctx.obj, "app", None) is None:
        raise CommandError(NO_APP)
    _log_to_stderr(verbose)


def app_of(ctx: click.Context) -> Any:
    """The Celery app `celery -A` loaded, its task modules imported so verbs see a worker's tasks."""
    if app_argument(ctx) is None:
        # Celery's fallback app: refuse before anything (a SQLite store file here) is made for it.
        raise CommandError(NO_APP, EX_CONFIG)
    app = ctx.obj.app
    state = app_state(app)
    if not state.modules_loaded:
        app.loader.import_default_modules()
        state.modules_loaded = True
    return app


def store_of(ctx: click.Context) -> Store:
    """The app's lease store, not migrated implicitly, with the long call bound (history scans, indexes)."""
    from ..store import for_app

    return for_app(app_of(ctx), check=False, operator=True)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
