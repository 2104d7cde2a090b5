"""A change list paginator that never counts a whole table: Django's ``COUNT(*)`` reads every row of a
jobs table of millions for each page, so this counts at most ``COUNT_LIMIT``."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.utils.functional import cached_property

__all__ = ["BoundedPaginator", "COUNT_LIMIT"]

COUNT_LIMIT = 10_000  # rows counted at most


class BoundedPaginator(Paginator):
    """``count`` is the number of rows up to ``COUNT_LIMIT``; ``capped`` says whether there are more."""

    limit = COUNT_LIMIT

    @cached_property
    def counted(self) -> int:
        rows = self.object_list
        if isinstance(rows, QuerySet):  # unordered: which rows are counted does not matter, a sort reads all
            return int(rows.order_by()[: self.limit + 1].count())
        return len(rows[: self.limit + 1])

    @cached_property
    def count(self) -> int:
        return min(self.counted, self.limit)

    @property
    def capped(self) -> bool:
        return self.counted > self.limit
