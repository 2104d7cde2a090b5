"""Verbs that act or serve: migrate, reap, check, exporter, web (the scripted ones: no prompt)."""

from __future__ import annotations

from typing import Any

import click

from ..ops.views import aged_reason, with_ages
from ..vocabulary import Severity
from .base import CommandError, app_of, json_option, lease, store_of
from .output import echo, emit_json, table

__all__ = ["migrate", "reap", "check", "exporter", "web", "with_ages", "aged_reason"]


@lease.command()
@click.option("--sql", "as_sql", is_flag=True,
              help="Print the DDL instead of running it (for a DBA); changes nothing.")
@click.option("--to", "to", default="head", show_default=True, metavar="REV",
              help="The revision to move to; an older one downgrades (a rollback), with --yes only.")
@click.option("--yes", "-y", is_flag=True,
              help="Downgrade to an older --to: its DDL drops what later revisions added (see --sql).")
@json_option
@click.pass_context
def migrate(ctx: click.Context, as_sql: bool, to: str, yes: bool, as_json: bool) -> None:
    """Bring the lease store's schema to the newest revision (or --to REV).

    An empty store is created; a store made by the first release is recognised and
    stamped, not recreated. Workers only ever create an empty store themselves.
    """
    import celery_lease.store.migrating as migrating

    store = store_of(ctx)
    if as_sql:
        echo(migrating.sql(store, to), nl=False)
        return
    done = store.migrate(to, downgrade=yes)
    revision, _ = store.schema_state()
    if not yes and to != "head" and revision != to and not done:
        raise CommandError(f"lease store {store.safe_url} is at revision {revision}: moving --to {to} is a "
                           "downgrade, which drops what later revisions added (kept results among them); "
                           f"review it with `celery lease migrate --to {to} --sql`, then run "
                           f"`celery lease migrate --to {to} --yes`")
    if as_json:
        emit_json({"store": store.safe_url, "done": done, "revision": revision})
    elif done:
        echo(f"lease store {store.safe_url}:")
        echo("\n".join(f"  {what}" for what in done))
    else:
        echo(f"lease store {store.safe_url}: already at revision {revision}, nothing to do")


@lease.command()
@click.option("--dry-run", is_flag=True, help="Show what the reaper would do now and why; change nothing.")
@json_option
@click.pass_context
def reap(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Run the reaper once now (with --dry-run: only say what it would do)."""
    from ..reaper.run import Reaper

    store = store_of(ctx)
    result = Reaper(app_of(ctx), store).run_once(dry_run=dry_run)
    planned = with_ages(store, [d.as_dict() for d in result.planned])
    if as_json:
        emit_json({**result.as_dict(), "planned": planned} if dry_run else result.as_dict())
        return
    if dry_run:
        rows = [{**d, "reason": aged_reason(d), "delay": f"{d['delay']:.1f}s" if d["delay"] else ""}
                for d in planned]
        echo(table(rows, [("job_id", "job"), ("task", "task"), ("decision", "would"),
                                ("reason", "reason"), ("owner", "owner"), ("delay", "delay"),
                                ("queue", "queue")], empty="the reaper would change nothing now"))
        echo(f"dry run: {result.summary()}")
    elif result.skipped:
        echo("another reaper holds the reaper lock; nothing done")
    else:
        echo(f"reaped: {result.summary()}")


def _finding_lines(f: dict[str, Any]) -> str:
    """One line for a passed check; the settings, values, why and fix under a failed one."""
    head = f"{f['level'].upper():<8}{f['code']}"
    if f["level"] == Severity.OK:
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
    from ..ops.checks import run_checks

    findings = [f.as_dict() for f in run_checks(app_of(ctx))]
    errors = sum(1 for f in findings if f["level"] == Severity.ERROR)
    if as_json:
        emit_json(findings)
    else:
        echo("\n".join(_finding_lines(f) for f in findings) or "no checks ran")
        warnings = sum(1 for f in findings if f["level"] == Severity.WARNING)
        echo(f"\n{errors} error(s), {warnings} warning(s), {len(findings) - errors - warnings} ok")
    if errors:
        raise CommandError(f"{errors} check(s) failed; apply the fixes above")


@lease.command()
@click.option("--port", default=9808, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.pass_context
def exporter(ctx: click.Context, port: int, addr: str) -> None:
    """Serve Prometheus metrics of the lease store on http://ADDR:PORT/metrics (read-only)."""
    from ..ops.metrics import make_exporter

    try:
        server = make_exporter(app_of(ctx), port, addr)
    except ImportError as exc:
        raise CommandError(str(exc)) from exc
    except OSError as exc:
        raise CommandError(f"cannot listen on {addr}:{port} ({exc}); pick another --port") from exc
    host, bound = str(server.server_address[0]), server.server_address[1]
    click.echo(f"celery_lease exporter on http://{host}:{bound}/metrics (Ctrl-C to stop)", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@lease.command()
@click.option("--port", default=9809, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Address to listen on (the page can act: keep it on this machine or behind a proxy).")
@click.option("--allow-actions", is_flag=True,
              help="Let the page redrive and discard dead letters (read-only without it).")
@click.option("--url-prefix", default="", metavar="PATH",
              help="Serve under this path, as a reverse proxy forwards it (e.g. /lease).")
@click.pass_context
def web(ctx: click.Context, port: int, bind: str, allow_actions: bool, url_prefix: str) -> None:
    """Serve the operator's web page on http://BIND:PORT/ (overview, jobs, reaper, dead letters)."""
    from ..config import app_config

    try:
        from ..web.app import create_app, make_server
        from ..web.security import is_loopback
    except ImportError as exc:
        from ..web import INSTALL_HINT

        raise CommandError(f"{INSTALL_HINT} ({exc})") from exc
    if url_prefix and not url_prefix.startswith("/"):
        raise click.BadParameter("a path that starts with /, e.g. /lease", param_hint="--url-prefix")
    app, store = app_of(ctx), store_of(ctx)
    cfg = app_config(app)
    guarded = cfg.web_token is not None or cfg.web_basic_auth is not None
    if allow_actions and not guarded and not is_loopback(bind):
        raise CommandError(f"--allow-actions on {bind} would let anyone who reaches it change jobs: set "
                           "lease_web_token or lease_web_basic_auth, or --bind 127.0.0.1 behind a proxy")
    store.ensure_schema()
    try:
        server = make_server(create_app(app, store, allow_actions=allow_actions), bind, port, url_prefix)
    except OSError as exc:
        raise CommandError(f"cannot listen on {bind}:{port} ({exc}); pick another --port") from exc
    mode = "actions allowed" if allow_actions else "read-only"
    click.echo(f"celery_lease web on http://{server.effective_host}:{server.effective_port}"
               f"{url_prefix.rstrip('/')}/ ({mode}; Ctrl-C to stop)", err=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
