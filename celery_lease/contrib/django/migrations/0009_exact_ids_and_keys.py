"""Store revision 0009 on the database CELERY_LEASE_DATABASE names (contrib/django/schema.py)."""

from django.db import migrations

from celery_lease.contrib.django.schema import RunStoreRevision

revision = "0009"


class Migration(migrations.Migration):
    atomic = False  # the store migrates on its own connections, never in Django's transaction
    dependencies = [("celery_lease", "0008_effect_nonce")]
    operations = [RunStoreRevision(revision)]
