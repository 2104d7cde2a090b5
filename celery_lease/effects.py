"""Moved to ``celery_lease.worker.effects``; this path is kept for a while and warns."""

import warnings

from celery_lease.worker.effects import *  # noqa: F403
from celery_lease.worker.effects import __all__ as __all__

warnings.warn("celery_lease.effects moved to celery_lease.worker.effects; import it from there",
              DeprecationWarning, stacklevel=2)
