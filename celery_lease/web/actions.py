"""Redrive or discard dead letters from the page (the CLI's moves): the plan first, then the confirmation.

The confirmation carries each job's ``updated_at`` as the plan showed it: a job changed in between is
skipped, not moved on a plan that no longer describes it."""

from __future__ import annotations

from typing import Any

from flask import Flask, abort, g, render_template, request

import celery_lease.ops.recovery as recovery

from ..ops.views import job_plan
from ..vocabulary import DeadLetterAction, RecoveryAction
from .console import Console, console

__all__ = ["register", "BATCH", "ACTIONS"]

BATCH = 10  # jobs at most per action, as the CLI's default --batch: recover in small batches
ACTIONS = {
    DeadLetterAction.REDRIVE: ("redrive", "send back to their queue with fresh attempts",
                               RecoveryAction.REDRIVEN),
    DeadLetterAction.DISCARD: ("delete for good", "delete from the store (their events stay)",
                               RecoveryAction.DISCARDED),
}


def _request() -> tuple[Console, DeadLetterAction, list[str]]:
    c = console()
    if not c.allow_actions:
        abort(403, "this page is read-only: start it with `celery lease web --allow-actions` to redrive or "
                   "discard dead letters (or use `celery lease dlq redrive|discard`)")
    action = request.form.get("action", "")
    if action not in ACTIONS:
        abort(400, f"unknown action {action!r}; one of {', '.join(ACTIONS)}")
    ids = [i for i in request.form.getlist("job") if i]
    if len(ids) > BATCH:
        abort(400, f"{len(ids)} jobs selected; select at most {BATCH} (recover in small batches, watch the "
                   "effects, then go on)")
    return c, DeadLetterAction(action), ids


def register(web: Flask) -> None:
    @web.post("/dead-letters/plan", endpoint="plan")
    def plan() -> Any:
        c, action, ids = _request()
        task = request.form.get("task") or None
        jobs, refused = recovery.dead_letter_plan(c.store, action, ids or None, task, BATCH)
        return render_template("plan.html", page="dead_letters", action=action, verb=ACTIONS[action],
                               jobs=jobs, rows=job_plan(c.store, jobs), refused=refused, task=task,
                               batch=BATCH, stamps={j.id: recovery.stamp(j) for j in jobs})

    @web.post("/dead-letters/apply", endpoint="apply")
    def apply() -> Any:
        c, action, ids = _request()
        if request.form.get("confirm") != "yes" or not ids:
            abort(400, "nothing confirmed: plan the action first and confirm it")
        stamps = dict(zip(ids, request.form.getlist("stamp"), strict=False))
        jobs, refused = recovery.dead_letter_plan(c.store, action, ids, batch=BATCH)
        who = recovery.operator("web", g.get("user") or "anonymous", request.remote_addr or "unknown")
        outcomes = list(recovery.recover_dead_letters(c.app, c.store, action, jobs, who, stamps))
        status = 200 if not any(o.action == RecoveryAction.PUBLISH_FAILED for o in outcomes) else 502
        return render_template("done.html", page="dead_letters", action=action, verb=ACTIONS[action],
                               outcomes=outcomes, refused=refused, who=who,
                               done=ACTIONS[action][2]), status
