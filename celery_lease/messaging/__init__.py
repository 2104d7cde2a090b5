"""What celery_lease says to Celery's broker, result backend and event stream (imports the core and
store/ only)."""
