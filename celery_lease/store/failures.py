"""What a driver or pool error means for a caller, in words an operator can act on.

Only a missing table or column asks for a migration; an unreachable server or an exhausted pool is an outage:
the caller fails closed and retries."""

from __future__ import annotations

import sqlalchemy as sa

from ..errors import LeaseError, StoreConflict, StoreNotMigrated, StoreRejected, StoreUnavailable
from ..vocabulary import StoreFailure

__all__ = ["classify", "KINDS"]

# The kinds a dialect reads from a driver error (a pool timeout is SQLAlchemy's, never a driver's).
KINDS = tuple(kind for kind in StoreFailure if kind != StoreFailure.POOL)
_HINTS = {
    StoreFailure.CONSTRAINT: "a row broke a constraint of the lease tables",
    StoreFailure.PERMISSION: "grant the store's database user SELECT, INSERT, UPDATE and DELETE on the lease "
                             "tables",
    StoreFailure.SYNTAX: "the server does not understand a statement of celery_lease; check its version",
    StoreFailure.DATA: "a value does not fit its column",
}


def _generic(exc: Exception) -> StoreFailure:
    if isinstance(exc, sa.exc.TimeoutError):
        return StoreFailure.POOL
    if isinstance(exc, sa.exc.IntegrityError):
        return StoreFailure.CONSTRAINT
    if isinstance(exc, sa.exc.DataError):
        return StoreFailure.DATA
    if isinstance(exc, (sa.exc.ProgrammingError, sa.exc.NotSupportedError)):
        return StoreFailure.SYNTAX
    return StoreFailure.UNREACHABLE


def classify(exc: Exception, where: str, bounds: object, kind: StoreFailure | None) -> LeaseError:
    """The LeaseError for ``exc`` on the store ``where``; ``kind`` is the dialect's reading, or None."""
    kind = kind or _generic(exc)
    detail = getattr(exc, "orig", None) or exc
    call = getattr(bounds, "call", None)
    if kind == StoreFailure.MISSING:
        return StoreNotMigrated(f"lease store {where} lacks a table or column ({detail}); "
                                "run `celery -A proj lease migrate`", kind=kind)
    if kind == StoreFailure.CONFLICT:
        return StoreConflict(f"lease store {where}: a row with that key exists ({detail})", kind=kind)
    if kind in _HINTS:
        return StoreRejected(f"lease store {where} refused a statement ({kind}: {detail}); {_HINTS[kind]}",
                             kind=kind)
    if kind == StoreFailure.POOL:
        return StoreUnavailable(f"lease store {where} unreachable: no pooled connection came free within "
                                f"{getattr(bounds, 'pool', 0):g}s ({detail}); every connection is busy or "
                                "hung; raise the pool size (lease_store_engine_options) or find what "
                                "holds them", kind=kind)
    if kind == StoreFailure.TIMEOUT:
        return StoreUnavailable(f"lease store {where} unreachable: no answer within the call bound of "
                                f"{call:g}s ({detail}); check the database's load and locks", kind=kind)
    return StoreUnavailable(f"lease store {where} unreachable: {detail}; check lease_store_url and that "
                            "the database is running", kind=StoreFailure.UNREACHABLE)
