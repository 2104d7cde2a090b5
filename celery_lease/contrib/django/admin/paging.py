"""A change list paginator that never counts a whole table.

Django's paginator asks ``COUNT(*)`` of the filtered rows; on a jobs table of millions of rows that
reads every row (or a whole index) for each page. :class:`BoundedPaginator` counts at most
``COUNT_LIMIT`` rows (``SELECT COUNT(*) FROM (SELECT ... LIMIT n)``), so a page costs the same
with a thousand rows or a million; past the limit the list says "more than" and pages no further
than the limit. Filters and search narrow the list below it.
"""

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
        """Rows counted, at most one past the limit."""
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
