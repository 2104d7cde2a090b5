"""The lease store in Django's admin: add ``"celery_lease.contrib.django.admin"`` to ``INSTALLED_APPS``.

This package imports nothing at import time: Django imports it as ``celery_lease.contrib.django``'s
``admin`` module too.
"""
