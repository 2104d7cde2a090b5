"""Read-only, unmanaged models over the store's tables: the store's migrations own them, and message
bodies and results are not mapped, so the admin never loads them."""

from __future__ import annotations

from django.db import models

from ....store.schema import ID, STATUSES
from ....vocabulary import Status
from .fields import EpochTimeField

__all__ = ["Job", "Event", "DeadLetter", "RunningLease"]


class Job(models.Model):
    """One row of the jobs table."""

    id = models.CharField(max_length=ID, primary_key=True)
    queue_name = models.CharField("queue", max_length=ID, null=True)
    task_name = models.CharField("task", max_length=ID)
    status = models.CharField(max_length=16, choices=[(s, s) for s in STATUSES])
    attempt_count = models.IntegerField("attempts")
    max_attempts = models.IntegerField()
    expired_count = models.IntegerField("expirations")
    dispatch_count = models.IntegerField("dispatches")
    available_at = EpochTimeField()
    started_at = EpochTimeField(null=True)
    completed_at = EpochTimeField(null=True)
    failed_at = EpochTimeField(null=True)
    last_heartbeat_at = EpochTimeField(null=True)
    lease_expires_at = EpochTimeField(null=True)
    lease_duration = models.FloatField(null=True)
    grace_period = models.FloatField(null=True)
    locked_by = models.CharField("owner", max_length=ID, null=True)
    lock_token = models.CharField(max_length=64, null=True)
    idempotency_key = models.CharField(max_length=ID, null=True)
    checkpoint = models.TextField(null=True)
    last_error = models.TextField(null=True)
    created_at = EpochTimeField()
    updated_at = EpochTimeField()

    class Meta:
        managed = False
        db_table = "celery_lease_jobs"
        default_permissions = ("view",)
        verbose_name = "job"

    def __str__(self) -> str:
        return f"{self.task_name} {self.id}"


class Event(models.Model):
    """One row of the audit log; its job may be gone (discarded or pruned)."""

    id = models.BigIntegerField(primary_key=True)
    job = models.ForeignKey(Job, models.DO_NOTHING, db_column="job_id", db_constraint=False, null=True,
                            related_name="events")
    event = models.CharField(max_length=64)
    reason = models.TextField(null=True)
    worker = models.CharField("by", max_length=ID, null=True)
    token = models.CharField(max_length=16, null=True)
    at = EpochTimeField()
    detail = models.TextField(null=True)
    queue_name = models.CharField("queue", max_length=ID, null=True)
    task_name = models.CharField("task", max_length=ID, null=True)

    class Meta:
        managed = False
        db_table = "celery_lease_events"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.event} {self.job_id or ''}".strip()


class _StatusManager(models.Manager["Job"]):
    def __init__(self, status: Status) -> None:
        super().__init__()
        self.status = status

    def get_queryset(self) -> models.QuerySet[Job]:
        return super().get_queryset().filter(status=self.status.value)


class DeadLetter(Job):
    """A failed job: what the reaper or a final failure dead-lettered. Redrive and discard act on these."""

    objects = _StatusManager(Status.FAILED)

    class Meta:
        proxy = True
        default_permissions = ("view",)
        permissions = (("redrive_deadletter", "Can redrive dead letters"),
                       ("discard_deadletter", "Can discard dead letters"))


class RunningLease(Job):
    """A running job and its lease: owner, last heartbeat, expiry."""

    objects = _StatusManager(Status.RUNNING)

    class Meta:
        proxy = True
        default_permissions = ("view",)
