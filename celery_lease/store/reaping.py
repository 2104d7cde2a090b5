"""Statements of the reaper: scans of abandoned leases and lost dispatches, recovery CAS, pruning."""

from __future__ import annotations

from .base import StoreBase

__all__ = ["ReaperStatements"]


class ReaperStatements(StoreBase):
    """Statements of the reaper: scans of abandoned leases and lost dispatches, recovery CAS, pruning."""
