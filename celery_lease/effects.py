"""Moved to ``celery_lease.worker.effects`` and ``celery_lease.worker.locks``; this path is kept for a while
and warns."""

import warnings

from celery_lease.worker.effects import *  # noqa: F403
from celery_lease.worker.effects import __all__ as _effects
from celery_lease.worker.locks import *  # noqa: F403
from celery_lease.worker.locks import __all__ as _locks

__all__ = [*_effects, *_locks]

warnings.warn("celery_lease.effects moved to celery_lease.worker.effects and celery_lease.worker.locks; "
              "import it from there", DeprecationWarning, stacklevel=2)
