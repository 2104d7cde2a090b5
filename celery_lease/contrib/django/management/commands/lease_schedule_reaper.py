"""``manage.py lease_schedule_reaper``: the reaper's django-celery-beat periodic task, set as ``lease check``
asks (idempotent)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from .....ops.reaper_checks import REAP_TASK, REAPER_ENTRY, REAPER_EXPIRES, REAPER_INTERVAL, REAPER_QUEUE

__all__ = ["Command"]


class Command(BaseCommand):
    help = ("Create or update django-celery-beat's periodic task for the lease reaper (celery_lease.reap) "
            "with its interval, a queue of its own and an expiry below the interval.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default=REAPER_ENTRY, help="the periodic task's name")
        parser.add_argument("--interval", type=int, default=REAPER_INTERVAL, help="seconds between runs")
        parser.add_argument("--queue", default=REAPER_QUEUE,
                            help="the reaper's own queue (run a worker with -Q on it)")
        parser.add_argument("--expires", type=int, default=None,
                            help=f"seconds after which a queued run is dropped (default: {REAPER_EXPIRES} "
                                 f"for the default interval, else two thirds of the interval)")

    def handle(self, *args: Any, name: str, interval: int, queue: str, expires: int | None,
               **options: Any) -> None:
        from django.apps import apps

        if not apps.is_installed("django_celery_beat"):
            raise CommandError("django_celery_beat is not in INSTALLED_APPS: pip install django-celery-beat, "
                               "add it, run manage.py migrate, then run this command again")
        from django_celery_beat.models import IntervalSchedule, PeriodicTask

        if interval < 2:
            # A run expires after at least 1s and before the next: a 1s interval leaves no such expiry.
            raise CommandError(f"--interval {interval}: give a whole number of seconds, at least 2, so a "
                               "queued run can expire before the next one is sent")
        if expires is None:
            expires = REAPER_EXPIRES if interval == REAPER_INTERVAL else max(1, interval * 2 // 3)
        if not 1 <= expires < interval:
            raise CommandError(f"--expires {expires}: give seconds below the {interval}s interval (and at "
                               "least 1), so runs that queued up are dropped instead of firing at once")
        try:
            self._schedule(IntervalSchedule, PeriodicTask, name, interval, queue, expires)
        except DatabaseError as exc:
            raise CommandError(f"cannot read or write django-celery-beat's tables ({exc}): if they are "
                               "missing, run manage.py migrate django_celery_beat, then this command "
                               "again") from exc

    def _schedule(self, IntervalSchedule: Any, PeriodicTask: Any, name: str, interval: int,  # noqa: N803
                  queue: str, expires: int) -> None:
        row = PeriodicTask.objects.filter(name=name).first()
        seconds = {"every": interval, "period": IntervalSchedule.SECONDS}
        every = row.interval if row is not None else None
        if every is None or (every.every, every.period) != (interval, IntervalSchedule.SECONDS):
            # Not get_or_create: django-celery-beat lets equal schedules be saved twice (its admin does).
            every = IntervalSchedule.objects.filter(**seconds).order_by("pk").first()
            if every is None:
                every = IntervalSchedule.objects.create(**seconds)
        wanted = {"task": REAP_TASK, "interval": every, "crontab": None, "solar": None, "clocked": None,
                  "queue": queue, "expire_seconds": expires, "expires": None, "one_off": False,
                  "enabled": True}
        if row is None:
            PeriodicTask.objects.create(name=name, **wanted)
            self.stdout.write(f"created periodic task {name!r}: {REAP_TASK} every {interval}s on queue "
                              f"{queue!r}, expires {expires}s")
            return
        changed = [field for field, value in wanted.items() if getattr(row, field) != value]
        if not changed:
            self.stdout.write(f"periodic task {name!r} is already set: nothing to change")
            return
        for field in changed:
            setattr(row, field, wanted[field])
        row.save()
        self.stdout.write(f"updated periodic task {name!r} ({', '.join(changed)}): {REAP_TASK} every "
                          f"{interval}s on queue {queue!r}, expires {expires}s")
