"""celery_lease as a Django app: add ``"celery_lease.contrib.django"`` to ``INSTALLED_APPS``.

``manage.py check`` then validates every ``CELERY_LEASE_*`` setting of the project's Celery
app, each problem a ``django.core.checks.Error`` that names the setting as written and
suggests the closest valid name (checks.py).
"""
