"""The lease store's admin pages, read-only: jobs with their events, dead letters, running leases, the
audit log. No page counts or scans a whole table; the only moves are the dead-letter actions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from django.contrib import admin
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

import celery_lease.store as stores

from ....vocabulary import DeadLetterAction
from ....vocabulary import Event as EventName
from .actions import recover
from .models import DeadLetter, Event, Job, RunningLease
from .paging import COUNT_LIMIT, BoundedPaginator
from .tables import celery_app, store_alias

__all__ = ["JobAdmin", "DeadLetterAdmin", "RunningLeaseAdmin", "EventAdmin", "REDRIVE", "DISCARD"]

SAMPLE = COUNT_LIMIT  # rows whose queues and tasks a filter lists


class SampledValuesFilter(admin.AllValuesFieldListFilter):
    """Django's filter by a column's values, those among ``SAMPLE`` rows: a DISTINCT would read every row."""

    def __init__(self, field: Any, request: HttpRequest, params: Any, model: Any, model_admin: Any,
                 field_path: str) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        sample = model_admin.get_queryset(request).order_by().values_list(field_path, flat=True)[:SAMPLE]
        values = set(sample)
        chosen = self.lookup_val  # a list of values on Django 5, a value before
        values.update(chosen if isinstance(chosen, list) else [chosen] if chosen else [])
        self.lookup_choices = sorted(values, key=lambda v: (v is not None, v or ""))  # None: "(None)" choice


QUEUE_AND_TASK = (("queue_name", SampledValuesFilter), ("task_name", SampledValuesFilter))
REDRIVE = "celery_lease_admin.redrive_deadletter"
DISCARD = "celery_lease_admin.discard_deadletter"


class ReadOnlyOnStore:
    """An admin or inline that reads the store's database and changes nothing."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(store_alias())  # type: ignore[misc]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class StoreAdmin(ReadOnlyOnStore, admin.ModelAdmin):
    """Read-only, on the store's database, never counting a whole table."""

    paginator = BoundedPaginator
    show_full_result_count = False
    list_per_page = 50

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Sequence[str]:
        return [field.name for field in self.model._meta.fields]


class ExactSearch:
    """Search by exact job id or idempotency key: an index lookup, never a scan of the table."""

    search_fields = ("id", "idempotency_key")
    search_help_text = "An exact job id or idempotency key."

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any],
                           search_term: str) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(Q(pk=term) | Q(idempotency_key=term)), False


class DeadLetterActions:
    """Redrive and discard, each shown to (and run for) users with its permission only."""

    actions = ("redrive", "discard")

    def has_redrive_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(REDRIVE)

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(DISCARD)

    @admin.action(description="Redrive the selected dead letters", permissions=["redrive"])
    def redrive(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        return recover(self, request, queryset, DeadLetterAction.REDRIVE)

    @admin.action(description="Discard the selected dead letters", permissions=["discard"])
    def discard(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        return recover(self, request, queryset, DeadLetterAction.DISCARD)


class EventInline(ReadOnlyOnStore, admin.TabularInline):
    """A job's audit trail on its page, oldest first."""

    model = Event
    fields = ("at", "event", "reason", "worker", "token", "detail")
    readonly_fields = fields
    ordering = ("id",)
    extra = 0
    can_delete = False


JOB_FIELDSETS = (
    (None, {"fields": ("id", "task_name", "queue_name", "status", "idempotency_key")}),
    ("Attempts", {"fields": ("attempt_count", "max_attempts", "expired_count", "dispatch_count",
                             "last_error")}),
    ("Lease", {"fields": ("locked_by", "lock_token", "lease_expires_at", "last_heartbeat_at",
                          "lease_duration", "grace_period", "checkpoint")}),
    ("Times", {"fields": ("created_at", "available_at", "started_at", "completed_at", "failed_at",
                          "updated_at")}),
)


@admin.register(Job)
class JobAdmin(DeadLetterActions, ExactSearch, StoreAdmin):
    list_display = ("id", "task_name", "queue_name", "status", "attempt_count", "locked_by",
                    "lease_expires_at", "updated_at")
    list_filter = ("status", *QUEUE_AND_TASK)
    # Running, pending, failed, completed, each newest first: the (status, updated_at) index read
    # backwards, where "newest first" over all statuses would sort the whole table.
    ordering = ("-status", "-updated_at")
    fieldsets = JOB_FIELDSETS
    inlines = (EventInline,)


@admin.register(DeadLetter)
class DeadLetterAdmin(DeadLetterActions, ExactSearch, StoreAdmin):
    list_display = ("id", "task_name", "queue_name", "attempt_count", "failed_at", "error")
    list_filter = QUEUE_AND_TASK
    ordering = ("-updated_at",)
    fieldsets = JOB_FIELDSETS
    inlines = (EventInline,)

    @admin.display(description="last error")
    def error(self, job: Job) -> str:
        text = " ".join((job.last_error or "").split())
        return text if len(text) <= 100 else text[:99] + "…"


@admin.register(RunningLease)
class RunningLeaseAdmin(ExactSearch, StoreAdmin):
    list_filter = QUEUE_AND_TASK
    ordering = ("lease_expires_at",)
    fieldsets = JOB_FIELDSETS
    inlines = (EventInline,)

    def get_list_display(self, request: HttpRequest) -> Sequence[str | Callable[[Any], Any]]:
        now = stores.for_app(celery_app()).now()  # the store's clock, as the reaper reads expiry

        @admin.display(description="expires in")
        def expires_in(job: Job) -> str:
            if job.lease_expires_at is None:
                return "no expiry"
            left = job.lease_expires_at.timestamp() - now
            return f"{left:.1f}s" if left >= 0 else f"expired {-left:.1f}s ago"

        return ("id", "task_name", "queue_name", "locked_by", "attempt_count", "last_heartbeat_at",
                "lease_expires_at", expires_in)


class EventNameFilter(admin.SimpleListFilter):
    """The event names of the vocabulary: no query for the choices."""

    title = "event"
    parameter_name = "event"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name.value, name.value) for name in EventName]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(event=self.value()) if self.value() else queryset


@admin.register(Event)
class EventAdmin(StoreAdmin):
    list_display = ("at", "event", "job_link", "worker", "reason", "queue_name", "task_name")
    list_filter = (EventNameFilter,)
    search_fields = ("job_id",)
    search_help_text = "An exact job id."
    ordering = ("-id",)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any],
                           search_term: str) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        return (queryset.filter(job_id=term) if term else queryset), False

    @admin.display(description="job", ordering="job_id")
    def job_link(self, event: Event) -> str:
        if not event.job_id:
            return ""
        url = reverse("admin:celery_lease_admin_job_change", args=[event.job_id])
        return format_html('<a href="{}">{}</a>', url, event.job_id)
