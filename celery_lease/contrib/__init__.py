"""Files for tools around celery_lease (Prometheus alert rules)."""
