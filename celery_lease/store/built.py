"""The built form of an audited write: its statements, made once per store and reused."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa

__all__ = ["_Audited", "_Positional"]


@dataclasses.dataclass(frozen=True)
class _Audited:
    """An audited write, built once: one statement (``statement``, or ``compiled`` for the driver
    with its result ``columns``), or an ``update`` and its ``audit`` insert for one transaction."""

    statement: Any = None
    compiled: tuple[str, Mapping[str, Any]] | None = None
    columns: list[str] = dataclasses.field(default_factory=list)
    update: Any = None
    audit: Any = None
    positional: tuple[_Positional, ...] | None = None  # the write's statements, for the driver


@dataclasses.dataclass(frozen=True)
class _Positional:
    """A statement compiled once for a driver of positional parameters (SQLite's ``?``), with the type
    conversions SQLAlchemy would apply on the way in and out (a Boolean stored as an integer)."""

    sql: str
    names: tuple[str, ...]
    static: Mapping[str, Any]
    binds: Mapping[str, Callable[[Any], Any]]
    results: tuple[Callable[[Any], Any] | None, ...] = ()

    @classmethod
    def compile(cls, statement: Any, dialect: sa.Dialect,
                columns: list[sa.Column] | None = None) -> _Positional:
        compiled = statement.compile(dialect=dialect)
        names = tuple(compiled.positiontup or ())
        binds = {name: proc for name in names
                 if (proc := compiled.binds[name].type.bind_processor(dialect)) is not None}
        results = tuple(c.type.result_processor(dialect, None) for c in columns or ())
        return cls(compiled.string, names, compiled.construct_params(_check=False), binds, results)

    def parameters(self, bind: Mapping[str, Any]) -> tuple[Any, ...]:
        values = []
        for name in self.names:
            value = bind[name] if name in bind else self.static[name]
            convert = self.binds.get(name)
            values.append(value if convert is None or value is None else convert(value))
        return tuple(values)

    def row(self, values: Any) -> list[Any]:
        return [v if convert is None or v is None else convert(v)
                for convert, v in zip(self.results, values, strict=True)]
