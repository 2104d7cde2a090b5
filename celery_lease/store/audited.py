"""Audited writes: a transition of one job row and its audit event, as one atomic write.

The hot transitions go through here, built once per store (``_Audited``) and run in one round trip; a
first claim or its owner's completion is the row's write alone unless lease_audit_every_transition."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY

from ..vocabulary import Event
from .base import StoreEngine
from .rows import Job, storable

__all__ = ["AuditedWrites"]


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


def _unnested(types: Mapping[str, Any], name: str) -> Any:
    """PostgreSQL: the rows that the array parameters ``many_<column>`` (one per column of ``types``)
    unnest to, as table ``name``: a batch's values in one statement compiled once."""
    return sa.func.unnest(*(sa.cast(sa.bindparam(f"many_{column}"), ARRAY(t)) for column, t in types.items())
                          ).table_valued(*(sa.column(column, t) for column, t in types.items())
                                         ).render_derived(name=name)


def _arrays(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> dict[str, list[Any]]:
    """The ``many_<column>`` parameters of _unnested(): each column's values across ``rows``."""
    return {f"many_{column}": [row[column] for row in rows] for column in columns}


def _bind(params: dict[str, Any] | None, job_id: str, reason: str | None, worker: str | None,
          token: str | None, detail: Any) -> dict[str, Any]:
    """A write's parameters with its audit event's."""
    return {**(params or {}), "ev_job": job_id, "ev_reason": reason and storable(reason), "ev_worker": worker,
            "ev_token": token[:8] if token else None,
            "ev_detail": None if detail is None else json.dumps(detail, default=str)}


class AuditedWrites:
    """The audited one-row writes the job transitions are made of."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def _audited(self, stmt: sa.Update | Callable[[], sa.Update], job_id: str, event: Event | None,
                 reason: str | None, worker: str | None, token: str | None, detail: Any,
                 key: str | None, params: dict[str, Any] | None, full_row: bool) -> Any:
        """A one-row UPDATE and its audit event as one atomic write: the changed row, or None.
        On PostgreSQL one autocommit statement of data-modifying CTEs, elsewhere one transaction. With ``key``
        the statements are built once and reused: building them costs more CPU than running them."""
        built = self._built_for(stmt, event, key, full_row)
        bind = _bind(params, job_id, reason, worker, token, detail)
        if built.compiled is not None:
            return self._execute_compiled(built, bind)
        if built.positional is not None:
            return self._execute_positional(built, bind)
        if built.statement is not None:
            with self.db._driver_errors(), self.db.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                return conn.execute(built.statement, bind).first()
        return self._audited_in_transaction(built, bind, job_id, full_row)

    def _built_for(self, stmt: sa.Update | Callable[[], sa.Update], event: Event | None, key: str | None,
                   full_row: bool) -> _Audited:
        """The write's statements: with ``key`` built once per store and reused."""
        if key and event is None:
            key = f"{key}_unaudited"
        built = self.db._built.get(key) if key else None
        if built is None:
            built = self._build_audited(stmt() if callable(stmt) else stmt, event, full_row, bool(key))
            if key:
                self.db._built[key] = built
        return built

    def _unaudited_rows(self, stmt: Callable[[], sa.Update], key: str,
                        writes: Sequence[tuple[str, dict[str, Any]]]) -> list[Job | None] | None:
        """Unaudited one-row writes of one kind (first claims), each as _audited_row() makes it, in one
        transaction on SQLite's driver: each one's new row or None. None where the write has no such
        form (each is then written alone)."""
        built = self._built_for(stmt, None, key, True)
        if built.positional is None:
            return None
        rows = self._execute_positional_rows(
            built, [_bind(params, job_id, None, None, None, None) for job_id, params in writes])
        return [None if row is None else Job.from_row(row) for row in rows]

    def _audited_row(self, stmt: sa.Update | Callable[[], sa.Update], job_id: str, event: Event | None, *,
                     worker: str | None = None, token: str | None = None, key: str | None = None,
                     params: dict[str, Any] | None = None) -> Job | None:
        """The audited write of a transition that hands its caller the job (a claim): the new row or None."""
        row = self._audited(stmt, job_id, event, None, worker, token, None, key, params, True)
        return None if row is None else Job.from_row(row)

    def _audited_write(self, stmt: sa.Update | Callable[[], sa.Update], job_id: str, event: Event | None,
                       reason: str | None = None, worker: str | None = None, token: str | None = None,
                       detail: Any = None, *, key: str | None = None,
                       params: dict[str, Any] | None = None) -> bool:
        """The audited write of a fenced transition: whether it happened."""
        row = self._audited(stmt, job_id, event, reason, worker, token, detail, key, params, False)
        return row is not None

    def _audited_in_transaction(self, built: _Audited, bind: dict[str, Any], job_id: str,
                                full_row: bool) -> Any:
        with self.db.begin() as c:
            if self.db.dialect.update_returning:
                row = c.execute(built.update, bind).first()
            elif c.execute(built.update, bind).rowcount == 1:
                row = c.execute(sa.select(*self._row_columns(full_row))
                                .where(self.db.t.jobs.c.id == job_id)).first()
            else:
                row = None
            if row is not None and built.audit is not None:
                c.execute(built.audit, bind)
        return row

    def _row_columns(self, full_row: bool) -> list[sa.Column]:
        # A claim needs the lease and progress columns; the stored message stays in the store.
        jobs = self.db.t.jobs
        return [c for c in self.db._job_columns() if c is not jobs.c.payload] if full_row else [jobs.c.id]

    def _build_audited(self, stmt: sa.Update, event: Event | None, full_row: bool, reused: bool) -> _Audited:
        columns = self._row_columns(full_row)
        if event is None:
            return self._build_unaudited(stmt, columns, reused)
        values = dict(
            event=sa.literal(str(event), sa.String()), reason=sa.bindparam("ev_reason", type_=sa.Text()),
            worker=sa.bindparam("ev_worker", type_=sa.String()),
            token=sa.bindparam("ev_token", type_=sa.String()), at=self.db.now_sql,
            detail=sa.bindparam("ev_detail", type_=sa.Text()),
        )
        job = sa.bindparam("ev_job", type_=sa.String())
        values.update(self.db._job_labels(job))
        if not self.db.dialect.one_statement_writes:
            update = stmt.returning(*columns) if self.db.dialect.update_returning else stmt
            event_insert = sa.insert(self.db.t.events).values(job_id=job, **values)
            if not (reused and self.db.dialect.compiled_fast_path and self.db.dialect.update_returning):
                return _Audited(update=update, audit=event_insert)
            dialect = self.db.engine.dialect
            return _Audited(columns=[c.name for c in columns], positional=(
                _Positional.compile(update, dialect, columns), _Positional.compile(event_insert, dialect)))
        changed = stmt.returning(*columns).cte("changed")
        audit = sa.insert(self.db.t.events).from_select(
            ["job_id", *values], sa.select(changed.c.id, *values.values())
        ).cte("audit")
        statement = sa.select(changed).add_cte(audit)
        if not (reused and self.db.dialect.compiled_fast_path):
            return _Audited(statement=statement)
        compiled = statement.compile(dialect=self.db.engine.dialect)
        static = compiled.construct_params(_check=False)  # the literals SQLAlchemy made parameters
        return _Audited(compiled=(compiled.string, static), columns=[c.name for c in columns])

    def _build_unaudited(self, stmt: sa.Update, columns: list[sa.Column], reused: bool) -> _Audited:
        """The row's write alone, built as its audited form would be (one statement where it can)."""
        dialect = self.db.engine.dialect
        if not self.db.dialect.one_statement_writes:
            update = stmt.returning(*columns) if self.db.dialect.update_returning else stmt
            if not (reused and self.db.dialect.compiled_fast_path and self.db.dialect.update_returning):
                return _Audited(update=update)
            return _Audited(columns=[c.name for c in columns],
                            positional=(_Positional.compile(update, dialect, columns),))
        statement = stmt.returning(*columns)
        if not (reused and self.db.dialect.compiled_fast_path):
            return _Audited(statement=statement)
        compiled = statement.compile(dialect=dialect)
        return _Audited(compiled=(compiled.string, compiled.construct_params(_check=False)),
                        columns=[c.name for c in columns])

    def _execute_compiled(self, built: _Audited, bind: dict[str, Any]) -> dict[str, Any] | None:
        """Run a statement compiled once on a pooled driver connection, in autocommit: its row or None.
        Skips SQLAlchemy's execution layer, whose cold path costs as much CPU as the round trip; driver errors
        are wrapped as SQLAlchemy's so that they map as elsewhere."""
        rows = self._execute_compiled_rows(built, bind, 1)
        return rows[0] if rows else None

    def _execute_compiled_rows(self, built: _Audited, bind: dict[str, Any],
                               limit: int | None = None) -> list[dict[str, Any]]:
        """_execute_compiled(), every row the statement returns (at most ``limit``)."""
        assert built.compiled is not None
        sql, static = built.compiled
        dbapi = self.db.engine.dialect.loaded_dbapi
        with self.db._driver_errors():
            try:
                raw = self.db.engine.raw_connection()
                try:
                    driver: Any = raw.driver_connection  # psycopg's: autocommit, closed
                    driver.autocommit = True
                    try:
                        with contextlib.closing(raw.cursor()) as cursor:
                            cursor.execute(sql, {**static, **bind})
                            values = cursor.fetchmany(limit) if limit is not None else cursor.fetchall()
                    finally:
                        if not driver.closed:
                            driver.autocommit = False
                finally:
                    # A dead connection fails its reset here and the pool discards it.
                    raw.close()
            except dbapi.Error as exc:
                raise sa.exc.DBAPIError.instance(sql, None, exc, dbapi.Error, hide_parameters=True,
                                                 dialect=self.db.engine.dialect) from exc
        return [dict(zip(built.columns, row, strict=True)) for row in values]

    def _execute_positional(self, built: _Audited, bind: dict[str, Any]) -> dict[str, Any] | None:
        """SQLite's hot writes: a write's statements, compiled once, in one transaction as begin() opens it
        (writer turn, write lock up front); the first one's row ({} when it returns none), or None.
        SQLAlchemy's execution layer costs more CPU than these writes; an UPDATE ... RETURNING that finds no
        row runs nothing after it."""
        return self._execute_positional_rows(built, [bind])[0]

    def _execute_positional_rows(self, built: _Audited,
                                 binds: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        """_execute_positional() for each of ``binds``, in one transaction: each one's row or None."""
        assert built.positional is not None
        first, *rest = built.positional
        rows: list[dict[str, Any] | None] = []
        with self._driver_transaction() as (cursor, running):
            for bind in binds:
                running[0] = first.sql
                cursor.execute(first.sql, first.parameters(bind))
                values = cursor.fetchone() if first.results else ()
                if values is not None:
                    for then in rest:
                        running[0] = then.sql
                        cursor.execute(then.sql, then.parameters(bind))
                rows.append(None if values is None else dict(zip(built.columns, first.row(values),
                                                                 strict=True)))
        return rows

    def _execute_positional_many(self, built: _Audited, binds: list[dict[str, Any]]) -> None:
        """SQLite: a write's statements, compiled once, each run for every one of ``binds`` in one
        transaction as _execute_positional() opens it. For writes that return no row (inserts)."""
        assert built.positional is not None
        with self._driver_transaction() as (cursor, running):
            for statement in built.positional:
                running[0] = statement.sql
                cursor.executemany(statement.sql, [statement.parameters(bind) for bind in binds])

    @contextlib.contextmanager
    def _driver_transaction(self) -> Iterator[tuple[Any, list[str]]]:
        """A driver cursor in a write transaction as begin() opens it (writer turn, write lock up front),
        committed when the block ends; the block names the statement it runs in ``running[0]``, so that
        a driver error is wrapped as SQLAlchemy's with it."""
        dbapi = self.db.engine.dialect.loaded_dbapi
        running = ["BEGIN"]
        with self.db._driver_errors(), self.db._writer_turn(self.db.bounds, False):
            try:
                raw = self.db.engine.raw_connection()
                try:
                    cursor = raw.cursor()
                    try:
                        self.db.dialect.begin_write(raw, self.db.bounds)
                        try:
                            yield cursor, running
                            running[0] = "COMMIT"
                            cursor.execute("COMMIT")
                        except BaseException:
                            # Still in the writer turn; a connection too dead to roll back: the pool drops it.
                            with contextlib.suppress(dbapi.Error):
                                raw.rollback()
                            raise
                    finally:
                        cursor.close()
                finally:
                    raw.close()
            except dbapi.Error as exc:
                raise sa.exc.DBAPIError.instance(running[0], None, exc, dbapi.Error, hide_parameters=True,
                                                 dialect=self.db.engine.dialect) from exc
