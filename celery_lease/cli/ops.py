"""Verbs that act or serve: migrate, reap, requeue, dlq list/redrive, check, exporter."""

from __future__ import annotations

from collections import Counter
from typing import Any

import click

from .. import recovery
from ..vocabulary import RecoveryAction
from .base import CommandError, app_of, json_option, lease, store_of
from .output import emit_json, is_tty, progress, table, when

__all__ = ["migrate", "reap", "requeue", "dlq", "check", "exporter"]

OUTCOME_COLUMNS = [("job_id", "job"), ("task", "task"), ("queue", "queue"), ("action", "action"),
                   ("reason", "reason")]


@lease.command()
@click.option("--sql", "as_sql", is_flag=True,
              help="Print the DDL instead of running it (for a DBA); changes nothing.")
@click.option("--to", "to", default="head", show_default=True, metavar="REV",
              help="The revision to move to; an older one downgrades (a rollback).")
@json_option
@click.pass_context
def migrate(ctx: click.Context, as_sql: bool, to: str, as_json: bool) -> None:
    """Bring the lease store's schema to the newest revision (or --to REV).

    An empty store is created; a store made by the first release is recognised and
    stamped, not recreated. Workers only ever create an empty store themselves.
    """
    from ..store import migrations

    store = store_of(ctx)
    if as_sql:
        revision, _ = store.schema_state()
        click.echo(migrations.sql(store.url, store.prefix, to, start=revision), nl=False)
        return
    done = store.migrate(to)
    revision, _ = store.schema_state()
    if as_json:
        emit_json({"store": store.safe_url, "done": done, "revision": revision})
    elif done:
        click.echo(f"lease store {store.safe_url}:")
        click.echo("\n".join(f"  {what}" for what in done))
    else:
        click.echo(f"lease store {store.safe_url}: already at revision {revision}, nothing to do")


@lease.command()
@click.option("--dry-run", is_flag=True, help="Show what the reaper would do now and why; change nothing.")
@json_option
@click.pass_context
def reap(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Run the reaper once now (with --dry-run: only say what it would do)."""
    from ..reaper import Reaper

    result = Reaper(app_of(ctx), store_of(ctx)).run_once(dry_run=dry_run)
    if as_json:
        emit_json(result.as_dict())
        return
    if dry_run:
        rows = [{**d.as_dict(), "delay": f"{d.delay:.1f}s" if d.delay else ""} for d in result.planned]
        click.echo(table(rows, [("job_id", "job"), ("task", "task"), ("decision", "would"),
                                ("reason", "reason"), ("owner", "owner"), ("delay", "delay"),
                                ("queue", "queue")], empty="the reaper would change nothing now"))
        click.echo(f"dry run: {result.summary()}")
    elif result.skipped:
        click.echo("another reaper holds the reaper lock; nothing done")
    else:
        click.echo(f"reaped: {result.summary()}")


def _report(outcomes: list[recovery.Outcome], done: RecoveryAction, batch: int, as_json: bool) -> None:
    counts = Counter(o.action for o in outcomes)
    skipped, failed = counts[RecoveryAction.SKIPPED], counts[RecoveryAction.PUBLISH_FAILED]
    if as_json:
        emit_json({"batch": batch, "outcomes": [o.as_dict() for o in outcomes], done.value: counts[done],
                   RecoveryAction.SKIPPED.value: skipped, RecoveryAction.PUBLISH_FAILED.value: failed})
    else:
        click.echo(table([o.as_dict() for o in outcomes], OUTCOME_COLUMNS, empty="nothing to do"))
        full = len(outcomes) >= batch
        more = " (the batch was full: watch the effects, then run again for more)" if full else ""
        click.echo(f"{done} {counts[done]}, skipped {skipped}, publish failed {failed}; batch {batch}{more}")
    if failed:
        raise CommandError(f"{failed} job(s) are pending without a message; "
                           "see the reasons above")


@lease.command()
@click.option("--job", "job_id", help="Requeue this job.")
@click.option("--expired", is_flag=True, help="Requeue expired leases of dead owners, oldest first.")
@click.option("--batch", default=10, show_default=True, type=click.IntRange(1),
              help="Jobs at most in this run (recover in small batches).")
@click.option("--force", is_flag=True, help="Also take live leases and re-publish pending jobs: may run a "
              "job twice if its worker still works on it.")
@json_option
@click.pass_context
def requeue(ctx: click.Context, job_id: str | None, expired: bool, batch: int, force: bool,
            as_json: bool) -> None:
    """Give jobs of dead workers back to the queue (CAS on the lease token, audited manual_requeue).

    Without --force only leases that expired past their grace period and whose owner is
    gone are taken: the same rule as the reaper's. Check `lease reap --dry-run` first.
    """
    if job_id is not None and expired:
        raise click.UsageError("use either --job ID or --expired")
    app, store = app_of(ctx), store_of(ctx)
    jobs = recovery.requeue_plan(app, store, job_id, expired, batch, force)
    with progress(jobs, "requeueing", not as_json and is_tty()) as items:
        outcomes = list(recovery.requeue(app, store, items, force))
    _report(outcomes, RecoveryAction.REQUEUED, batch, as_json)


@lease.group()
def dlq() -> None:
    """Dead letters: jobs that ended failed."""


@dlq.command("list")
@click.option("--task", help="Only dead letters of this task.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1), help="Rows at most.")
@json_option
@click.pass_context
def dlq_list(ctx: click.Context, task: str | None, limit: int, as_json: bool) -> None:
    """Failed jobs, oldest failure first."""
    from .reads import job_dict

    store = store_of(ctx)
    found = store.dead_letters(task, limit)
    if as_json:
        emit_json([job_dict(j) for j in found])
        return
    rows = [{"id": j.id, "task": j.task_name, "queue": j.queue_name,
             "failed": when(j.failed_at or j.updated_at),
             "attempts": f"{j.attempt_count}/{j.max_attempts}", "expired": j.expired_count,
             "error": (j.last_error or "").splitlines()[0][:80] if j.last_error else ""} for j in found]
    click.echo(table(rows, [("id", "job"), ("task", "task"), ("queue", "queue"), ("failed", "failed at"),
                            ("attempts", "attempts"), ("expired", "expirations"), ("error", "last error")],
                     empty="no dead letters"))


@dlq.command("redrive")
@click.option("--job", "job_id", help="Redrive this job (also one that was revoked).")
@click.option("--task", help="Only dead letters of this task.")
@click.option("--batch", default=10, show_default=True, type=click.IntRange(1),
              help="Jobs at most in this run; revoked jobs are left out unless named with --job.")
@json_option
@click.pass_context
def dlq_redrive(ctx: click.Context, job_id: str | None, task: str | None, batch: int, as_json: bool) -> None:
    """Send dead letters back to their queue with fresh attempts (audited dlq_redriven)."""
    app, store = app_of(ctx), store_of(ctx)
    jobs = recovery.redrive_plan(store, job_id, task, batch)
    with progress(jobs, "redriving", not as_json and is_tty()) as items:
        outcomes = list(recovery.redrive(app, store, items))
    _report(outcomes, RecoveryAction.REDRIVEN, batch, as_json)


def _finding_lines(f: dict[str, Any]) -> str:
    """One line for a passed check; the settings, values, why and fix under a failed one."""
    head = f"{f['level'].upper():<8}{f['code']}"
    if f["level"] == "ok":
        return f"{head}: {f['why']}"
    values = ", ".join(f"{k}={v!r}" for k, v in (f.get("values") or {}).items())
    lines = [head, f"        settings: {', '.join(f.get('settings') or ()) or '-'}"]
    if values:
        lines.append(f"        values:   {values}")
    lines += [f"        why:      {f['why']}", f"        fix:      {f['fix']}"] if f.get("fix") else [
        f"        why:      {f['why']}"]
    return "\n".join(lines)


@lease.command()
@json_option
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Walk the operational checklist over the live config and store; non-zero exit on errors."""
    from ..checks import run_checks

    findings = [f.as_dict() for f in run_checks(app_of(ctx))]
    errors = sum(1 for f in findings if f["level"] == "error")
    if as_json:
        emit_json(findings)
    else:
        click.echo("\n".join(_finding_lines(f) for f in findings) or "no checks ran")
        warnings = sum(1 for f in findings if f["level"] == "warning")
        click.echo(f"\n{errors} error(s), {warnings} warning(s), {len(findings) - errors - warnings} ok")
    if errors:
        raise CommandError(f"{errors} check(s) failed; apply the fixes above")


@lease.command()
@click.option("--port", default=9808, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.pass_context
def exporter(ctx: click.Context, port: int, addr: str) -> None:
    """Serve Prometheus metrics of the lease store on http://ADDR:PORT/metrics (read-only)."""
    from ..metrics import make_exporter

    try:
        server = make_exporter(app_of(ctx), port, addr)
    except ImportError as exc:
        raise CommandError(str(exc)) from exc
    except OSError as exc:
        raise CommandError(f"cannot listen on {addr}:{port} ({exc}); pick another --port") from exc
    host, bound = server.server_address[:2]
    click.echo(f"celery_lease exporter on http://{host}:{bound}/metrics (Ctrl-C to stop)", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
