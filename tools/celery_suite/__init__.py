"""Celery's own integration tests run with every task a LeaseTask (``make test-celery``)."""
