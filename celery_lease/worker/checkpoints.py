"""A lease's checkpoints and the record of a job whose row vanished (a restored backup, a failover that lost
its last seconds): recorded again from the message the worker holds, under the lease's token."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import celery_lease.messaging.messages as messages

from ..errors import StoreRejected, StoreUnavailable
from ..vocabulary import Status
from .handles import LeaseHandle

__all__ = ["checkpoint", "recorded_again", "send_if_pending", "vanished_and_recorded_again",
           "write_pending_checkpoint", "held_back_first"]

log = logging.getLogger(__name__)


class Checkpointed(LeaseHandle, Protocol):
    """A lease (lease.Lease) as its checkpoints and its record-again path see it."""

    app: Any
    checkpoint_state: Any
    pending_checkpoint: tuple[Any] | None
    checkpoint_turn: threading.Lock

    @property
    def finishing(self) -> bool: ...

    def recorded_again(self) -> bool: ...


def checkpoint(lease: Checkpointed, state: Any) -> None:
    """Lease.checkpoint: write now, or keep the state for the heartbeat while the store is unreachable."""
    lease.check()
    # Under the lease's checkpoint turn: the heartbeat writing a held-back state must not land after this.
    with lease.checkpoint_turn:
        try:
            written = lease.store.jobs.checkpoint(lease.job_id, lease.token, state, lease.worker)
            if not written and lease.vanished_and_recorded_again():
                written = lease.store.jobs.checkpoint(lease.job_id, lease.token, state, lease.worker)
        except StoreUnavailable as exc:
            log.warning("job %s [%s]: checkpoint kept until the store answers (%s)", lease.job_id,
                        lease.token[:8], exc, extra={"action": "checkpoint_deferred"})
            lease.pending_checkpoint = (state,)
            lease.checkpoint_state = state
            return
        lease.pending_checkpoint = None
    if not written:
        lease.mark_lost("checkpoint rejected: token no longer matches")
        lease.check()
    lease.checkpoint_state = state


def recorded_again(lease: Checkpointed, record_again: Callable[[], bool] | None) -> bool:
    """The job's row vanished: record it again under this lease's token; True when it is ours again.

    An unreachable store is no answer: StoreUnavailable reaches the caller, whose write then waits
    for the store as it would had the write itself met the outage (a settle write is deferred)."""
    if record_again is None or lease.lost:
        return False
    try:
        again = record_again()
    except StoreRejected as exc:
        log.warning("job %s [%s]: its row vanished and could not be recorded again (%s)", lease.job_id,
                    lease.token[:8], exc)
        return False
    if again:
        log.error("job %s [%s]: its row vanished from the store; recorded again from the message it runs",
                  lease.job_id, lease.token[:8], extra={"action": "job_recorded_again"})
        return True
    # Refused because the row is back: the heartbeat and the body's write both find a vanished row, and the
    # one that records it second is told the job is running. Running under this token, it is ours.
    job = lease.store.get(lease.job_id)
    return job is not None and job.lock_token == lease.token and job.status == Status.RUNNING


def send_if_pending(lease: Checkpointed) -> bool:
    """After a write refused as stale: send a pending job's message again (extras are harmless); an error is
    logged, the reaper's dispatch scan sends it later."""
    try:
        job = lease.store.get(lease.job_id)
        if job is None or job.status != Status.PENDING or lease.app is None:
            return False
        messages.republish(lease.app, lease.job_id, job.payload)
    except Exception as exc:  # noqa: BLE001 - the dispatch scan sends it later
        log.warning("job %s: not sent again (%s); the reaper's dispatch scan will", lease.job_id, exc)
        return False
    log.info("job %s [%s]: pending after a write whose answer was lost; its message sent again",
             lease.job_id, lease.token[:8], extra={"action": "pending_job_sent_again"})
    return True


def vanished_and_recorded_again(lease: Checkpointed, record_again: Callable[[], bool] | None) -> bool:
    """After a fenced write changed nothing: whether the row had vanished and is ours again now."""
    if record_again is None:
        return False
    job = lease.store.get(lease.job_id)
    if job is not None:
        # The heartbeat, finding the row gone too, may have recorded it again in between.
        return job.lock_token == lease.token and job.status == Status.RUNNING and not lease.lost
    return lease.recorded_again()


def write_pending_checkpoint(lease: Checkpointed) -> None:
    """The heartbeat's part: write the checkpoint an outage held back (StoreUnavailable if still down)."""
    # The body writing a checkpoint now writes a newer state: the held-back one is left to it, and the
    # heartbeat (every lease's renewals) does not wait on this one's write.
    if not lease.checkpoint_turn.acquire(blocking=False):
        return
    try:
        pending = lease.pending_checkpoint
        if pending is None or lease.lost or lease.finishing:
            return
        try:
            written = lease.store.jobs.checkpoint(lease.job_id, lease.token, pending[0], lease.worker)
        except StoreRejected:
            if lease.pending_checkpoint is pending:  # refused for good: dropped (the caller logs it)
                lease.pending_checkpoint = None
            raise
        if not written:
            lease.mark_lost("checkpoint rejected: token no longer matches")
        elif lease.pending_checkpoint is pending:
            lease.pending_checkpoint = None
    finally:
        lease.checkpoint_turn.release()


def held_back_first(lease: Checkpointed, write: Callable[[], bool]) -> Callable[[], bool]:
    """A settle write that first writes the checkpoint an outage held back (the heartbeat leaves a finished
    body's): the job's next attempt resumes from it. An unreachable store defers both, in this order."""
    def both() -> bool:
        with lease.checkpoint_turn:
            pending = lease.pending_checkpoint
            if pending is not None:
                try:
                    lease.store.jobs.checkpoint(lease.job_id, lease.token, pending[0], lease.worker)
                except StoreRejected as exc:  # the settle write matters more than the progress
                    log.error("job %s [%s]: held-back checkpoint rejected by the store (%s); dropped",
                              lease.job_id, lease.token[:8], exc, extra={"action": "checkpoint_rejected"})
                if lease.pending_checkpoint is pending:
                    lease.pending_checkpoint = None
        return write()
    return both
