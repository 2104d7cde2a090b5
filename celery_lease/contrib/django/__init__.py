"""celery_lease as a Django app: add ``"celery_lease.contrib.django"`` to ``INSTALLED_APPS``."""
