"""The store URL of a Django database (``CELERY_LEASE_DATABASE``); it lives in store/django_database.py."""

from ...store.django_database import SETTING, store_url, url_from_settings

__all__ = ["SETTING", "store_url", "url_from_settings"]
