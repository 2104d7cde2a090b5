"""The store's times (epoch seconds on the store's clock) as Django datetimes."""

from __future__ import annotations

import datetime
from typing import Any

from django.db import models

__all__ = ["EpochTimeField"]


class EpochTimeField(models.FloatField):
    """A column of epoch seconds, read as an aware UTC datetime (and a datetime in a lookup written back)."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> datetime.datetime | None:
        return None if value is None else datetime.datetime.fromtimestamp(float(value), datetime.timezone.utc)

    def to_python(self, value: Any) -> Any:
        if value is None or isinstance(value, datetime.datetime):
            return value
        return datetime.datetime.fromtimestamp(float(value), datetime.timezone.utc)

    def get_prep_value(self, value: Any) -> Any:
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        return super().get_prep_value(value)

    def value_to_string(self, obj: Any) -> str:
        value = self.value_from_object(obj)
        return "" if value is None else value.isoformat()
