"""Read-mostly statements for operators: status, listings, metrics, manual recovery."""

from __future__ import annotations

from .base import StoreBase

__all__ = ["ReportStatements"]


class ReportStatements(StoreBase):
    """Read-mostly statements for operators: status, listings, metrics, manual recovery."""
