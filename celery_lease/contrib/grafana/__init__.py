"""A Grafana dashboard over the exporter's metrics: celery_lease.json (package data)."""
