"""Fenced effects (once per key) and a forward-only update. An effect's key is written before its block runs,
so two racers cannot both see ``first``, and taken back if the block raises."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from sqlalchemy.engine import Connection

import celery_lease.store.schema as schema

from ..context import BODY
from ..errors import LeaseLost, StoreRejected, StoreUnavailable
from ..store.base import uninterrupted
from ..store.caller import is_django
from ..store.django_database import holds_store_file
from ..store.effects import advance_statement
from ..vocabulary import EffectOutcome, Event, StoreFailure
from .handles import LeaseHandle

__all__ = ["effect", "advance", "connection_for", "refuse_autocommit"]

log = logging.getLogger(__name__)

INTERRUPTIONS = (SoftTimeLimitExceeded, TimeLimitExceeded)  # land in a block from outside (so does SIGUSR1)


def check_key(kind: str, key: str) -> None:
    # MySQL's INSERT IGNORE would truncate a longer key silently, merging distinct keys.
    if not isinstance(key, str) or not key or len(key) > schema.ID:
        raise ValueError(f"{kind} must be a non-empty string of at most {schema.ID} characters, got {key!r}")


def connection_for(using: str) -> Any:
    """This thread's Django connection for database alias ``using`` (``connections[using]``)."""
    try:
        from django.db import connections
    except ImportError as exc:
        raise ImportError("effect(using=...) names a Django database: pip install django") from exc
    return connections[using]


def refuse_autocommit(connection: Any, key: str) -> None:
    """A connection that commits each statement alone (Django's outside ``transaction.atomic()``, SQLAlchemy's
    in AUTOCOMMIT) would commit the key before the block runs: a crash before the block's own writes would
    lose the effect for good."""
    if is_django(connection) and connection.get_autocommit():
        alias = connection.alias
        raise ValueError(f"effect({key!r}) on Django database {alias!r} outside transaction.atomic(using="
                         f"{alias!r}): that connection is in autocommit, so the key would commit alone before"
                         " the block runs and a crash before the block's writes would lose the effect for"
                         f" good; wrap the block in transaction.atomic(using={alias!r})")
    # SQLAlchemy's own test of a connection's isolation (an execution option, or the engine's), 1.4 and 2.x.
    autocommit = getattr(connection, "_is_autocommit_isolation", None)
    if callable(autocommit) and autocommit():
        raise ValueError(f"effect({key!r}) on a SQLAlchemy connection in AUTOCOMMIT isolation: the key would "
                         "commit alone before the block runs and a crash before the block's writes would lose"
                         " the effect for good; pass a connection in a transaction (engine.begin()) without "
                         "isolation_level='AUTOCOMMIT'")


def refuse_in_own_transaction(store: Any, exc: StoreUnavailable, call: str, instead: str) -> None:
    """A write that timed out inside this thread's atomic block holding the store's SQLite file waited on
    itself: a clear error, not an outage to wait out until the lease is lost."""
    if holds_store_file(store):
        raise StoreRejected(f"{call} cannot write the lease store inside this thread's transaction.atomic(), "
                            f"which holds the SQLite file the store shares once it has written: {instead}, "
                            "or call it before the block writes", kind=StoreFailure.LOCKED_BY_CALLER) from exc


@contextlib.contextmanager
def effect(lease: LeaseHandle, key: str, connection: Connection | None = None) -> Iterator[bool]:
    """``with effect(lease, key) as first:`` do the side effect only when ``first``; a block that raises frees
    the key (in ``connection``'s transaction when given) so a later attempt performs it."""
    check_key("effect key", key)
    if connection is not None:
        refuse_autocommit(connection, key)
    lease.check()
    store = lease.store
    if connection is None:
        # One mark for every try of this call: a try that finds the key under it knows the key is its own
        # (an earlier try's commit went through, its answer lost) and not another attempt's.
        nonce = secrets.token_hex(16)
        unanswered = False

        def record() -> EffectOutcome:
            nonlocal unanswered
            try:
                return store.effects.record_effect(key, lease.job_id, lease.token, lease.worker, nonce)
            except StoreRejected:
                raise  # refused: nothing was written
            except StoreUnavailable as exc:
                refuse_in_own_transaction(store, exc, f"effect({key!r})", "use effect(key, using=<alias>)")
                unanswered = True  # its commit may have gone through: the key may be this call's
                raise
            except BaseException:
                unanswered = True  # a time limit or a kill landed in the call, after its commit perhaps
                raise

        # Shielded across the record: a loss held back during the call, or landing as the shield ends,
        # comes after the key it wrote is given back (its block will not run), never in place of the
        # call's answer with the key left recorded.
        outcome: EffectOutcome | None = None
        try:
            with uninterrupted():
                # An unreachable store is waited for until the local deadline, then LeaseLost.
                outcome = lease.patiently(record)
                if outcome == EffectOutcome.LOST and lease.vanished_and_recorded_again():
                    outcome = lease.patiently(record)
                if outcome == EffectOutcome.LOST and unanswered:
                    _release(lease, key, "lease moved on after a try whose answer was lost", nonce)
                if outcome == EffectOutcome.FIRST:
                    lease.check()
        except BaseException as exc:
            if outcome == EffectOutcome.FIRST or unanswered:
                # The block never ran: the key this call may have written is given back, by its nonce
                # (whoever holds the job now), or it would keep every later attempt from the effect.
                # Written outside the body's lease: a lost one's shield would refuse the call at its start.
                outside = BODY.set(None)
                try:
                    _release(lease, key, f"{type(exc).__name__} while the key was recorded; the block did "
                             "not run", nonce)
                finally:
                    BODY.reset(outside)
            raise
    else:
        outcome = store.effects.record_effect_in(connection, key, lease.job_id, lease.token, lease.worker)
    if outcome == EffectOutcome.LOST:
        log.warning("job %s [%s]: effect %r rejected, the lease moved on", lease.job_id, lease.token[:8], key,
                    extra={"action": "stale_effect_rejected"})
        lease.mark_lost(f"effect {key!r} rejected: token no longer matches")
        lease.check()
    first = outcome == EffectOutcome.FIRST
    try:
        yield first
    except BaseException as exc:
        if first:
            _take_back(lease, key, connection, exc)
        raise


def _take_back(lease: LeaseHandle, key: str, connection: Connection | None, exc: BaseException) -> None:
    """The block failed: free its key so the effect is not lost, never masking its error. A block ended from
    outside (its lost lease, a time limit, not an ``Exception``) keeps it: that lands after the effect too."""
    reason = f"{type(exc).__name__}: {exc}"[:200]
    if connection is not None:
        try:
            lease.store.effects.unrecord_effect_in(connection, key, lease.job_id)
        except (StoreUnavailable, StoreRejected) as error:
            # An aborted transaction (PostgreSQL) can only roll back, and the rollback drops the key.
            log.info("job %s [%s]: effect %r left to the transaction's rollback (%s)", lease.job_id,
                     lease.token[:8], key, error, extra={"action": "effect_released"})
        return
    if isinstance(exc, LeaseLost) or lease.lost:
        _unconfirmed(lease, key, reason, "the lost lease")
    elif isinstance(exc, INTERRUPTIONS) or not isinstance(exc, Exception):
        _unconfirmed(lease, key, reason, f"an interruption ({type(exc).__name__})")
    else:
        _release(lease, key, reason)


def _unconfirmed(lease: LeaseHandle, key: str, reason: str, ended_by: str) -> None:
    """Keep the key of a block ended from outside, audited ``effect_unconfirmed``."""
    log.warning("job %s [%s]: effect %r ended by %s (%s); key kept, the effect may or may not have happened",
                lease.job_id, lease.token[:8], key, ended_by, reason, extra={"action": "effect_unconfirmed"})
    try:
        lease.store.event(lease.job_id, Event.EFFECT_UNCONFIRMED, f"block ended by {ended_by}; key kept",
                          worker=lease.worker, token=lease.token, detail={"key": key, "error": reason})
    except (StoreUnavailable, StoreRejected, LeaseLost) as error:
        # LeaseLost: the interruption still due lands on this call; the block's own error is the one raised.
        log.error("job %s [%s]: effect_unconfirmed for %r not audited (%s)", lease.job_id, lease.token[:8],
                  key, error, extra={"action": "effect_unconfirmed"})


def _release(lease: LeaseHandle, key: str, reason: str, nonce: str | None = None) -> None:
    """Free a key whose block did not do its effect, fenced by the job's token (or by the recording call's
    ``nonce``: a key that call may have recorded, when its lease is gone)."""
    try:
        released = lease.store.effects.release_effect(key, lease.job_id, lease.token, lease.worker, reason,
                                                      nonce)
    except (StoreUnavailable, StoreRejected) as error:
        if nonce is not None:  # most often nothing was written: say what to do if the key is there
            log.error("job %s [%s]: effect %r did not run (%s) and the key its call may have recorded could "
                      "not be given back (%s); if later attempts skip the effect, check the key with "
                      "`celery lease inspect %s` and free it with `celery lease effects forget`",
                      lease.job_id, lease.token[:8], key, reason, error, lease.job_id,
                      extra={"action": "effect_unconfirmed"})
            return
        log.error("job %s [%s]: effect %r failed (%s) and its key could not be released (%s); "
                  "the effect may not have happened", lease.job_id, lease.token[:8], key, reason, error,
                  extra={"action": "effect_unconfirmed"})
        return
    if not released and nonce is None:
        log.warning("job %s [%s]: effect %r failed after the lease was lost; key kept, the effect may "
                    "not have happened", lease.job_id, lease.token[:8], key,
                    extra={"action": "effect_unconfirmed"})


def advance(connection: Connection, column: sa.Column, where: sa.ColumnElement[bool], value: Any,
            order: Sequence[Any] | None = None) -> bool:
    """Set ``column`` to ``value`` where NULL or behind (``<``, or earlier in ``order``); True when a row
    moved."""
    return connection.execute(advance_statement(column, where, value, order)).rowcount > 0
