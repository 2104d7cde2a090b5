"""The `lease` command group, its error handling and what every verb shares.

Installed through the ``celery.commands`` entry point, so Celery loads the app
(``-A``) and hands it over in ``ctx.obj.app`` as it does for its own commands.
Every verb prints a table on a terminal and JSON with ``--json``; library errors
leave as one line that names the job or setting and what to do, with an exit
status that says which kind of failure it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..errors import LeaseConfigError, LeaseError, StoreUnavailable

if TYPE_CHECKING:
    from ..store import ReportStore

__all__ = ["lease", "CommandError", "app_of", "store_of", "json_option"]

EX_FAILURE, EX_UNAVAILABLE, EX_CONFIG = 1, 69, 78  # as celery.platforms / sysexits.h


class CommandError(click.ClickException):
    """A `celery lease` failure: printed as ``Error: ...`` on stderr, with its exit status."""

    def __init__(self, message: str, exit_code: int = EX_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _exit_code(exc: LeaseError) -> int:
    if isinstance(exc, StoreUnavailable):
        return EX_UNAVAILABLE
    if isinstance(exc, LeaseConfigError):
        return EX_CONFIG
    return EX_FAILURE


class LeaseGroup(click.Group):
    """Turns celery_lease errors raised by a verb into clean command errors."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LeaseError as exc:
            raise CommandError(str(exc), _exit_code(exc)) from exc


@click.group(name="lease", cls=LeaseGroup)
@click.pass_context
def lease(ctx: click.Context, **_: Any) -> None:
    """Leases, the reaper, dead letters and metrics of celery_lease jobs.

    The playbook for zombie jobs: confirm (status, inspect), scope (jobs, events),
    check the reaper before any manual recovery (reap --dry-run), recover in small
    batches (requeue, dlq redrive), then retune (tune, check).
    """
    if getattr(ctx.obj, "app", None) is None:
        raise CommandError("run this as a Celery subcommand: celery -A proj lease ...")


def app_of(ctx: click.Context) -> Any:
    """The Celery app that `celery -A` loaded."""
    return ctx.obj.app


def store_of(ctx: click.Context) -> ReportStore:
    """The app's lease store, not migrated implicitly (only `lease migrate` creates tables).

    An operator's command may scan history or create indexes: its calls get the long bound.
    """
    from ..store import for_app

    return for_app(app_of(ctx), check=False, operator=True)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
