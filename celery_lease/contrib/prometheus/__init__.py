"""Prometheus alert rules for celery_lease: alerts.yml (package data)."""
