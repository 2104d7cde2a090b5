"""Management commands of the celery_lease Django app."""
