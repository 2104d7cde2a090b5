"""Redrive and discard dead letters from the admin: ops.recovery's verbs, as the CLI runs them,
confirmed first (the first POST shows the plan)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.http import HttpRequest
from django.template.response import TemplateResponse

import celery_lease.ops.recovery as recovery
import celery_lease.store as stores

from ....vocabulary import DeadLetterAction, RecoveryAction
from .tables import celery_app

__all__ = ["BATCH", "VERBS", "operator", "recover"]

BATCH = 10  # jobs at most per action, as the CLI's default --batch and the web page
VERBS = {
    DeadLetterAction.REDRIVE: ("redrive", "send back to their queue with fresh attempts",
                               RecoveryAction.REDRIVEN),
    DeadLetterAction.DISCARD: ("discard", "delete from the store for good (their events stay)",
                               RecoveryAction.DISCARDED),
}
CONFIRM_TEMPLATE = "admin/celery_lease_admin/confirm_recovery.html"


def operator(request: HttpRequest) -> str:
    """The audit log's actor for an admin request: ``admin:USER@ADDRESS``."""
    user = getattr(request, "user", None)
    name = user.get_username() if user is not None and user.is_authenticated else "anonymous"
    return recovery.operator("admin", name, request.META.get("REMOTE_ADDR") or "unknown")


def _selected(request: HttpRequest, queryset: Any) -> list[str]:
    # The ids as posted: a job that left the list's filter since is refused with its reason, not dropped.
    if request.POST.get("select_across") == "1":
        return [str(pk) for pk in queryset.values_list("pk", flat=True)[: BATCH + 1]]
    return [pk for pk in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME) if pk]


def recover(model_admin: Any, request: HttpRequest, queryset: Any,
            action: DeadLetterAction) -> TemplateResponse | None:
    """Plan ``action`` (redrive or discard) for the selected jobs; once confirmed, move them."""
    ids = _selected(request, queryset)
    if len(ids) > BATCH:
        model_admin.message_user(request, f"more than {BATCH} jobs selected; select at most {BATCH} (recover "
                                 "in small batches, watch the effects, then go on)", messages.ERROR)
        return None
    app = celery_app()
    store = stores.for_app(app)
    jobs, refused = recovery.dead_letter_plan(store, action, ids, batch=BATCH)
    if request.POST.get("confirm") != "yes":
        context = {**model_admin.admin_site.each_context(request),
                   "title": f"{VERBS[action][0].capitalize()} dead letters?",
                   "opts": model_admin.model._meta, "action": action, "verb": VERBS[action],
                   "jobs": jobs, "stamped": [(job, recovery.stamp(job)) for job in jobs], "refused": refused,
                   "batch": BATCH, "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME}
        return TemplateResponse(request, CONFIRM_TEMPLATE, context)
    done = VERBS[action][2]
    # The confirmation carries each job as its plan showed it: one changed in between is skipped.
    stamps = dict(zip(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME), request.POST.getlist("stamp"),
                      strict=False))
    for outcome in recovery.recover_dead_letters(app, store, action, jobs, operator(request), stamps):
        level = messages.SUCCESS if outcome.action == done else messages.WARNING
        model_admin.message_user(request, f"{outcome.job_id} ({outcome.task}): {outcome.action}, "
                                 f"{outcome.reason}", level)
    for reason in refused:
        model_admin.message_user(request, f"refused: {reason}", messages.ERROR)
    return None
