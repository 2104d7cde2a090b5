"""The store's statements on a caller's DB-API connection: Django's, inside its ``atomic()``.

Wrapping Django's raw connection in an engine would hand SQLAlchemy the transaction (its first connect rolls
back, closing commits or rolls back). So each statement is compiled with the ``format`` paramstyle every
Django backend takes and run on Django's own cursor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

__all__ = ["CallerConnection", "is_django", "for_caller"]


def is_django(conn: Any) -> bool:
    """Whether ``conn`` is a Django database connection (a DatabaseWrapper), told without importing Django."""
    return hasattr(conn, "vendor") and hasattr(conn, "settings_dict") and hasattr(conn, "cursor")


class CallerResult:
    """What a statement on a caller's cursor gave: its row count and rows, as SQLAlchemy's result does."""

    def __init__(self, rowcount: int, rows: list[tuple[Any, ...]]) -> None:
        self.rowcount = rowcount
        self._rows = rows

    def first(self) -> tuple[Any, ...] | None:
        return self._rows[0] if self._rows else None

    def scalar(self) -> Any:
        row = self.first()
        return None if row is None else row[0]

    def scalars(self) -> Iterator[Any]:
        return (row[0] for row in self._rows)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self._rows)


class CallerConnection:
    """A Django connection seen as the part of a SQLAlchemy Connection the effect statements use;
    nothing here begins, commits or rolls back."""

    def __init__(self, wrapper: Any, dialect: Dialect) -> None:
        self.wrapper = wrapper
        self.vendor: str = wrapper.vendor
        # A dialect of the store's class that writes %s; the store's own engine keeps its style.
        formatting: Any = type(dialect)
        self.dialect: Dialect = formatting(paramstyle="format")
        self.dialect.server_version_info = dialect.server_version_info

    def execute(self, statement: ClauseElement) -> CallerResult:
        compiled = cast(SQLCompiler, statement.compile(dialect=self.dialect,
                                                        compile_kwargs={"render_postcompile": True}))
        values = compiled.construct_params() or {}
        params = []
        for name in compiled.positiontup or ():
            value = values[name]
            bind = compiled.binds.get(name)
            process = bind.type.bind_processor(self.dialect) if bind is not None else None
            params.append(process(value) if process is not None and value is not None else value)
        try:
            with self.wrapper.cursor() as cursor:
                cursor.execute(str(compiled), params)
                rows = [tuple(r) for r in cursor.fetchall()] if cursor.description else []
                return CallerResult(cursor.rowcount, rows)
        except sa.exc.SQLAlchemyError:
            raise
        except Exception as exc:
            # Django re-raises the driver's error as its own; the store classifies the driver's.
            driver = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            raise sa.exc.DBAPIError(str(compiled), params, driver) from exc


def for_caller(conn: Any, dialect: Dialect) -> Connection | CallerConnection:
    """``conn`` as the effect statements take it: a SQLAlchemy Connection as is, Django's wrapped."""
    if is_django(conn):
        return CallerConnection(conn, dialect)
    return conn
