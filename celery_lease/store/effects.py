"""Statements of fenced effects, checkpoints' neighbours and resource locks."""

from __future__ import annotations

from .base import StoreBase

__all__ = ["EffectStatements"]


class EffectStatements(StoreBase):
    """Statements of fenced effects, checkpoints' neighbours and resource locks."""
