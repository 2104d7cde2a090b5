"""``Task.replace()`` under a lease: the replaced job's id passes to the task frozen with it (its
carrier), fenced on the replaced run's token. A leased carrier sent now gets the row back to pending
just before its message; one sent later (a chain's last step) gets it removed in the transaction that
records the first step, so one of them is always in the store; an unleased carrier completes it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from celery.canvas import Signature, _chain, _chord, group
from celery.exceptions import Ignore

from ..context import HANDING as _handing
from ..context import HANDING_LATER as _later
from ..errors import StoreUnavailable
from ..kinds import leased
from ..store import NewJob
from ..vocabulary import RunEnd
from ..worker.handles import DeferredWrite

if TYPE_CHECKING:
    from ..store import Store
    from ..worker.lease import Lease

__all__ = ["hand_over", "hand_over_eager", "hands_over_to", "claim_on_publish", "record_step"]

log = logging.getLogger(__name__)


def carrier(sig: Signature, job_id: str, first: bool = True) -> tuple[Signature | None, bool]:
    """The signature frozen with ``job_id`` in a replacement, and whether it is published now."""
    if isinstance(sig, _chain):
        for index, step in enumerate(sig.tasks):
            found, now = carrier(step, job_id, first and index == 0)
            if found is not None:
                return found, now
        return None, False
    if isinstance(sig, _chord):
        header = sig.tasks if isinstance(sig.tasks, Signature) else group(sig.tasks)
        found, now = carrier(header, job_id, first)
        return (found, now) if found is not None else (carrier(sig.body, job_id, False)[0], False)
    if isinstance(sig, group):
        for member in sig.tasks:
            found, now = carrier(member, job_id, first)
            if found is not None:
                return found, now
        return None, False
    return (sig, first) if sig.id == job_id else (None, False)


def hand_over(task: Any, lease: Lease, sig: Signature, send: Callable[[Signature], Any]) -> Any:
    """Hand the job over to its replacement, then ``send`` it (Celery's on_replace: raises Ignore)."""
    found, now = carrier(sig, lease.job_id)
    target = task.app.tasks.get(found.task) if found is not None else None
    name = found.task if found is not None else type(sig).__name__
    store, job_id, token, worker = lease.store, lease.job_id, lease.token, lease.worker
    nesting = int(getattr(task.request, "replaced_task_nesting", 0) or 0)
    if target is not None and leased(target) and not now:
        first = _first_sent(sig)
        if first is None or not leased(task.app.tasks.get(first.task)):
            _hand_over_first(lease, name, nesting)
            return send(sig)
        later = _later.set((lease, name, nesting))
        try:
            return send(sig)
        except Ignore:
            # The first step was not recorded here (its publish took another way). Not deferred if the store
            # is away: the carrier, sent later, would find the row still running and be skipped, and then
            # the deferred write would remove the row: given back, the body runs again instead.
            with lease.turn:
                if not lease.handed_over:
                    lease.handed_over = store.replacing.hand_over(job_id, token, worker, None, name, nesting)
            raise
        finally:
            _later.reset(later)
    if target is not None and leased(target):
        with _handing_over(lease, nesting):
            return send(sig)
    try:
        return send(sig)
    except Ignore:
        _after_sent(lease, lambda: store.replacing.replaced(job_id, token, worker, name))
        raise


def hand_over_eager(task: Any, lease: Lease, sig: Signature, apply: Callable[[Signature], Any]) -> Any:
    """An eager ``replace()`` (a store-backed ``apply()``): Celery applies the replacement in this body and
    returns its value. A leased carrier's own claim would meet this run's lease, so the row is handed over
    first (removed; the carrier's claim records the job again) and this run writes nothing more."""
    found, now = carrier(sig, lease.job_id)
    if found is None or not now or not leased(task.app.tasks.get(found.task)):
        # Nothing claims the id (this run completes the job), or an eager chain, whose steps Celery applies
        # all under this id: each would meet the one before it as a duplicate.
        return apply(sig)
    _hand_over_first(lease, found.task, int(getattr(task.request, "replaced_task_nesting", 0) or 0))
    return apply(sig)


def _hand_over_first(lease: Lease, name: str, nesting: int) -> None:
    """Hand the job over before its replacement goes (which claims the id); a refused write ends the run."""
    with lease.turn:
        if not lease.store.replacing.hand_over(lease.job_id, lease.token, lease.worker, None, name, nesting):
            raise Ignore()
        lease.handed_over = True


def _after_sent(lease: Lease, write: Callable[[], bool]) -> None:
    """Record a hand-over whose replacement Celery has sent. A store that does not answer defers the write
    to the heartbeat, as a completion's is: given back, the body would run again and send the replacement
    twice."""
    with lease.turn:
        try:
            lease.handed_over = write()
        except StoreUnavailable as exc:
            log.error("job %s [%s]: replaced, but the hand-over is not written, the store is unreachable "
                      "(%s); kept until it answers", lease.job_id, lease.token[:8], exc,
                      extra={"action": "settle_deferred"})
            lease.handed_over = True
            lease.runtime.defer(lease, DeferredWrite(RunEnd.REPLACED, write))


def _first_sent(sig: Signature) -> Signature | None:
    """The single task a replacement sends first (a chain's first step); None when it starts with a group."""
    while isinstance(sig, _chain) and sig.tasks:
        sig = sig.tasks[0]
    return None if isinstance(sig, (group, _chord, _chain)) else sig


def record_step(store: Store, job_id: str, task_name: str, queue: str | None, payload: str | None,
                max_attempts: int, idempotency_key: str | None, delay: float,
                recovery: Mapping[str, Any] | None, reopen: bool) -> tuple[bool, str]:
    """A leased publish's record; while a job hands over to a carrier sent later, its first step is recorded
    in the transaction that removes the replaced row. Ignore when the replaced lease moved on."""
    later = _later.get()
    lease, carrier_name, nesting = later if later is not None else (None, "", 0)
    if lease is not None and idempotency_key is None and job_id != lease.job_id and not lease.handed_over:
        step = NewJob(job_id, task_name, queue, payload, max_attempts, delay, recovery)

        def write() -> bool | None:
            return lease.store.replacing.hand_over_to_step(lease.job_id, lease.token, lease.worker,
                                                           carrier_name, step, nesting)

        with lease.turn:
            done = write()
            if done is False and lease.vanished_and_recorded_again():
                done = write()  # the replaced row vanished (a restore): recorded again, then handed over
            if done is False:
                raise Ignore()
            if done is None:  # the step's id is taken: hand over, then record it as any publish
                if not lease.store.replacing.hand_over(lease.job_id, lease.token, lease.worker, None,
                                                       carrier_name, nesting):
                    raise Ignore()
            lease.handed_over = True
        if done:
            # Not "created": a failed send must not forget the step's row, which now carries the job.
            return False, job_id
    return store.publishes.record(job_id, task_name, queue, payload, max_attempts, idempotency_key, delay,
                                  recovery=recovery, reopen=reopen)


@contextlib.contextmanager
def _handing_over(lease: Lease, nesting: int) -> Iterator[None]:
    token = _handing.set((lease, nesting))
    try:
        yield
    finally:
        _handing.reset(token)


def hands_over_to(task_id: str) -> bool:
    """Whether a publish of ``task_id`` now is the carrier of a running job's replacement."""
    lease, _ = _handing.get() or (None, 0)
    return lease is not None and lease.job_id == task_id and not lease.handed_over


def claim_on_publish(task: Any, task_id: str, payload: str) -> bool:
    """Just before the carrier's message is published, the row goes back to pending, so its delivery finds it
    claimable; True when it did, Ignore when the replaced lease moved on."""
    lease, nesting = _handing.get() or (None, 0)
    if lease is None or lease.job_id != task_id or lease.handed_over:
        return False
    def write() -> bool:
        return lease.store.replacing.hand_over(lease.job_id, lease.token, lease.worker, payload, task.name,
                                               nesting)

    with lease.turn:
        if not write() and not (lease.vanished_and_recorded_again() and write()):
            raise Ignore()
        lease.handed_over = True
    return True
