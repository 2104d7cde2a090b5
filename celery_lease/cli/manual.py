"""Verbs that change jobs by hand: requeue, dlq redrive|discard, effects forget.

Each shows its plan, then asks; without a terminal or ``--yes`` nothing changes, so a pipeline never
changes jobs because nobody was asked.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import click

import celery_lease.ops.recovery as recovery

from ..ops.views import job_dict, job_plan
from ..vocabulary import RecoveryAction
from .base import CommandError, app_of, json_option, lease, store_of
from .output import echo, emit_json, is_tty, progress, table, when

__all__ = ["requeue", "dlq", "effects", "can_prompt", "job_plan"]

OUTCOME_COLUMNS = [("job_id", "job"), ("task", "task"), ("queue", "queue"), ("action", "action"),
                   ("reason", "reason")]
PLAN_COLUMNS = [("job_id", "job"), ("task", "task"), ("queue", "queue"), ("status", "status"),
                ("attempts", "attempts"), ("why", "why")]


def can_prompt() -> bool:
    """Whether an operator can answer a question (stdin and stdout are terminals); a seam for tests."""
    return sys.stdin.isatty() and sys.stdout.isatty()


dry_run_option = click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
yes_option = click.option("--yes", "-y", is_flag=True,
                          help="Do it without asking (needed when not on a terminal).")
batch_option = click.option("--batch", default=10, show_default=True, type=click.IntRange(1),
                            help="Jobs at most in this run (recover in small batches).")


def go_ahead(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], question: str,
             dry_run: bool, yes: bool, as_json: bool) -> bool:
    """Show the plan; True when the change may proceed (confirmed, or --yes)."""
    if as_json and (dry_run or not yes or not rows):
        emit_json({"dry_run": True, "planned": list(rows)})
    elif not as_json:
        echo(table(rows, columns, empty="nothing to do"))
    if not rows or dry_run:
        return False
    if yes:
        return True
    if not can_prompt():
        raise CommandError(f"not on a terminal, so nobody confirmed: nothing changed. {question[:1].upper()}"
                           f"{question[1:]}? Run again with --yes to do it, or --dry-run to only look")
    click.confirm(f"{question}?", abort=True, err=True)
    return True


def _recover(store: Any, jobs: list[Any], question: str, label: str,
             run: Callable[[Iterable[Any]], Iterable[recovery.Outcome]], done: RecoveryAction, batch: int,
             dry_run: bool, yes: bool, as_json: bool) -> None:
    if not go_ahead(job_plan(store, jobs), PLAN_COLUMNS, question, dry_run, yes, as_json):
        return
    with progress(jobs, label, not as_json and is_tty()) as items:
        outcomes = list(run(items))
    counts = Counter(o.action for o in outcomes)
    skipped, failed = counts[RecoveryAction.SKIPPED], counts[RecoveryAction.PUBLISH_FAILED]
    unsendable = counts[RecoveryAction.UNSENDABLE]
    if as_json:
        emit_json({"batch": batch, "outcomes": [o.as_dict() for o in outcomes], done.value: counts[done],
                   RecoveryAction.SKIPPED.value: skipped, RecoveryAction.PUBLISH_FAILED.value: failed,
                   RecoveryAction.UNSENDABLE.value: unsendable})
    else:
        echo(table([o.as_dict() for o in outcomes], OUTCOME_COLUMNS, empty="nothing to do"))
        full = len(outcomes) >= batch
        more = " (the batch was full: watch the effects, then run again for more)" if full else ""
        echo(f"{done} {counts[done]}, skipped {skipped}, publish failed {failed}, unsendable {unsendable}; "
             f"batch {batch}{more}")
    if failed:
        raise CommandError(f"{failed} job(s) are pending without a message; see the reasons above")
    if unsendable:
        raise CommandError(f"{unsendable} job(s) left as they were: their stored message cannot be read "
                           "back; see the reasons above")


@lease.command()
@click.option("--job", "job_id", help="Requeue this job (its id or a unique prefix of it).")
@click.option("--expired", is_flag=True, help="Requeue expired leases of dead owners, oldest first.")
@batch_option
@click.option("--force", is_flag=True, help="Also take live leases and re-publish pending jobs: may run a "
              "job twice if its worker still works on it.")
@dry_run_option
@yes_option
@json_option
@click.pass_context
def requeue(ctx: click.Context, job_id: str | None, expired: bool, batch: int, force: bool, dry_run: bool,
            yes: bool, as_json: bool) -> None:
    """Give jobs of dead workers back to the queue (CAS on the lease token, audited manual_requeue).

    Without --force only leases that expired past their grace period and whose owner is
    gone are taken: the same rule as the reaper's. Check `lease reap --dry-run` first.
    """
    if job_id is not None and expired:
        raise click.UsageError("use either --job ID or --expired")
    app, store = app_of(ctx), store_of(ctx)
    jobs = recovery.requeue_plan(app, store, job_id, expired, batch, force)
    verb = "requeue" + (" (forced: their workers may still run them)" if force else "")
    _recover(store, jobs, f"{verb} {len(jobs)} job(s)", "requeueing",
             lambda items: recovery.requeue(app, store, items, force, expired=expired),
             RecoveryAction.REQUEUED, batch, dry_run, yes, as_json)


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
    store = store_of(ctx)
    found = store.recovery.dead_letters(task, limit)
    if as_json:
        emit_json([job_dict(j) for j in found])
        return
    rows = [{"id": j.id, "task": j.task_name, "queue": j.queue_name,
             "failed": when(j.failed_at or j.updated_at),
             "attempts": f"{j.attempt_count}/{j.max_attempts}", "expired": j.expired_count,
             "error": (j.last_error or "")[:120]} for j in found]
    echo(table(rows, [("id", "job"), ("task", "task"), ("queue", "queue"), ("failed", "failed at"),
                      ("attempts", "attempts"), ("expired", "expirations"), ("error", "last error")],
               empty="no dead letters"))


@dlq.command("redrive")
@click.option("--job", "job_id", help="Redrive this job, also one that was revoked (id or unique prefix).")
@click.option("--task", help="Only dead letters of this task.")
@batch_option
@dry_run_option
@yes_option
@json_option
@click.pass_context
def dlq_redrive(ctx: click.Context, job_id: str | None, task: str | None, batch: int, dry_run: bool,
                yes: bool, as_json: bool) -> None:
    """Send dead letters back to their queue with fresh attempts (audited dlq_redriven).

    Revoked jobs are left out of a batch unless named with --job.
    """
    app, store = app_of(ctx), store_of(ctx)
    jobs = recovery.redrive_plan(store, job_id, task, batch)
    _recover(store, jobs, f"redrive {len(jobs)} dead letter(s)", "redriving",
             lambda items: recovery.redrive(app, store, items), RecoveryAction.REDRIVEN, batch,
             dry_run, yes, as_json)


@dlq.command("discard")
@click.option("--job", "job_id", help="Discard this job (its id or a unique prefix of it).")
@click.option("--task", help="Only dead letters of this task.")
@batch_option
@dry_run_option
@yes_option
@json_option
@click.pass_context
def dlq_discard(ctx: click.Context, job_id: str | None, task: str | None, batch: int, dry_run: bool,
                yes: bool, as_json: bool) -> None:
    """Delete dead letters from the store for good, oldest first (audited dlq_discarded).

    Their audit events stay; nothing is published. Use it for failures that will never be
    redriven (a task that no longer exists, bad input), after `lease dlq list`.
    """
    store = store_of(ctx)
    jobs = recovery.discard_plan(store, job_id, task, batch)
    _recover(store, jobs, f"delete {len(jobs)} dead letter(s) for good", "discarding",
             lambda items: recovery.discard(store, items), RecoveryAction.DISCARDED, batch,
             dry_run, yes, as_json)


@lease.group()
def effects() -> None:
    """Fenced effect keys (``self.lease.effect(key)``)."""


@effects.command("forget")
@click.argument("key")
@click.option("--force", is_flag=True,
              help="Forget it even while its job holds a live lease (you know the effect did not happen).")
@dry_run_option
@yes_option
@json_option
@click.pass_context
def effects_forget(ctx: click.Context, key: str, force: bool, dry_run: bool, yes: bool,
                   as_json: bool) -> None:
    """Delete an effect key, so that the next run of its effect block does the effect again.

    For an effect known not to have happened (the call failed after the key was recorded).
    Refused while its job holds a live lease, unless --force. Audited effect_forgotten under the
    job that recorded it.
    """
    store = store_of(ctx)
    found = recovery.forget_plan(app_of(ctx), store, key, force)
    row = {"key": found["key"], "job_id": found["job_id"], "recorded": when(found["at"])}
    if not go_ahead([row], [("key", "key"), ("job_id", "job"), ("recorded", "recorded at")],
                    f"forget effect key {key!r} (its effect may then happen again)", dry_run, yes, as_json):
        return
    done = recovery.forget(store, key, recorded=(found["job_id"], found["at"]), force=force)
    now = None if done else store.reports.effect_record(key)
    if now is None:
        why = "forgotten" if done else "already gone"
    elif (now["job_id"], now["at"]) != (found["job_id"], found["at"]):
        why = f"recorded again by job {now['job_id']} since the plan"
    else:
        why = f"its job {found['job_id']} took a live lease since the plan"
    if as_json:
        emit_json({"key": key, "job_id": found["job_id"], "forgotten": done, "outcome": why})
    elif done:
        echo(f"effect key {key!r} of job {found['job_id']} forgotten")
    elif now is None:
        echo(f"effect key {key!r} was already gone; nothing changed")
    if now is not None:
        raise CommandError(f"effect key {key!r} was not forgotten: {why}. Nothing changed; run the command "
                           "again to see the plan as it is now")
