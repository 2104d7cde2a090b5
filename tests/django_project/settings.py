"""Settings of the tiny Django project; DJANGO_PROJECT_LEASE (JSON) adds CELERY_LEASE_* settings."""

import json
import os

SECRET_KEY = "tests-only"
USE_TZ = True
INSTALLED_APPS = ["celery_lease.contrib.django"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.environ.get("DJANGO_PROJECT_DB", ":memory:")}}
CELERY_BROKER_URL = "memory://"
CELERY_LEASE_DURATION = 60
CELERY_LEASE_HEARTBEAT_INTERVAL = 5
globals().update(json.loads(os.environ.get("DJANGO_PROJECT_LEASE", "{}")))
