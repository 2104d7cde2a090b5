"""A tiny Django project laid out as Celery's Django guide does: its Celery app is imported here."""

from .celery_app import app

__all__ = ["app"]
