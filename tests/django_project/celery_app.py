"""The project's Celery app, configured from Django's settings under the CELERY namespace."""

from celery import Celery

app = Celery("django_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
