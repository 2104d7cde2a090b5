"""The lease store in Django's admin: add ``"celery_lease.contrib.django.admin"`` to ``INSTALLED_APPS``.

Read-only pages over the store's tables (jobs, their events, dead letters, running leases) and
two actions on dead letters, redrive and discard, behind permissions of their own. The pages
read the store through the Django database ``CELERY_LEASE_DATABASE`` names; the actions go
through celery_lease.ops.recovery, as ``celery lease dlq redrive|discard`` does. This package
imports nothing at import time: Django imports it as the ``admin`` module of
``celery_lease.contrib.django`` too.
"""
