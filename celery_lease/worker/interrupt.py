"""Raising LeaseLost inside a running body: an asynchronous exception for an OS thread, a throw from its hub
for a gevent greenlet; both land when the body next runs Python code. A store call in ``uninterrupted()``
defers it to the call's end, so no lock or pooled connection is left astray."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler

from ..context import BODY
from ..errors import LeaseLost
from ..store.base import uninterrupted

__all__ = ["Interrupter", "ThreadInterrupter", "GreenletInterrupter", "raise_in_thread", "for_process",
           "uninterrupted", "BODY", "SoftLimit", "soft_limit_held", "worker_terminating", "worker_leaving"]

log = logging.getLogger(__name__)


def raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> bool:
    """Raise ``exc_type`` asynchronously in a thread (None clears a pending one)."""
    count = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None
    )
    return count == 1


def _async_error(error: LeaseLost, landed: Callable[[], None]) -> type[LeaseLost]:
    # The interpreter instantiates an asynchronous exception with no arguments, in the target
    # thread, as it lands: that is how the interrupter learns it landed.
    job_id, reason, owner = error.job_id, error.reason, error.owner

    def __init__(self: LeaseLost) -> None:
        landed()
        LeaseLost.__init__(self, job_id, reason, owner)

    return type("LeaseLost", (LeaseLost,), {"__init__": __init__, "__module__": __name__})


class Interrupter:
    """Binds to the body's execution unit; ``interrupt`` raises LeaseLost in it if it still runs."""

    def bind(self) -> None:
        raise NotImplementedError

    def interrupt(self, error: LeaseLost, still_running: Callable[[], bool]) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        """The body is over: drop an interruption that has not landed yet."""

    def is_current(self) -> bool:
        """Whether the caller runs in the bound execution unit (the body's own)."""
        raise NotImplementedError


class ThreadInterrupter(Interrupter):
    """An OS thread: an asynchronous exception, cleared if the body ends first."""

    def __init__(self) -> None:
        self.thread_id: int | None = None
        self._pending = False  # sent and not landed yet

    def bind(self) -> None:
        self.thread_id = threading.get_ident()

    def interrupt(self, error: LeaseLost, still_running: Callable[[], bool]) -> None:
        # The body's own thread found the loss: it raises LeaseLost itself (check()).
        if self.thread_id is not None and self.thread_id != threading.get_ident() and still_running():
            self._pending = True
            if not raise_in_thread(self.thread_id, _async_error(error, self._landed)):
                self._pending = False

    def _landed(self) -> None:
        self._pending = False

    def cancel(self) -> None:
        """Called in the body's own thread. Clearing an exception through the C API would leave the
        interpreter's "asynchronous exception pending" flag set for good (CPython clears it only as one
        lands): every thread would then take the slow path at each call, and a profiler or tracer
        (cProfile, coverage) would hang. So only an interruption still on its way is dropped, by
        letting it land here."""
        if not self._pending or self.thread_id != threading.get_ident():
            return
        try:
            for _ in range(1000):  # bytecode to run: a pending asynchronous exception lands within it
                if not self._pending:
                    break
        except LeaseLost:
            pass  # noqa: SIM105 - the interruption this call drops, caught as it lands
        if self._pending:  # never seen: it did not land while bytecode ran; clear it as a last resort
            self._pending = False
            raise_in_thread(threading.get_ident(), None)

    def is_current(self) -> bool:
        return self.thread_id == threading.get_ident()


class GreenletInterrupter(Interrupter):
    """A gevent greenlet: thrown into from its hub, only while the body still runs."""

    def __init__(self) -> None:
        self.greenlet: Any = None
        self.hub: Any = None

    def bind(self) -> None:
        import gevent

        self.greenlet, self.hub = gevent.getcurrent(), gevent.get_hub()

    def interrupt(self, error: LeaseLost, still_running: Callable[[], bool]) -> None:
        import gevent

        if self.greenlet is None or self.greenlet is gevent.getcurrent():
            return  # unbound, or the body found the loss itself and raises LeaseLost

        def throw() -> None:
            # In the hub, the body switched out: it cannot finish between the check and the throw.
            if still_running() and not self.greenlet.dead:
                self.greenlet.throw(error)

        # Thread-safe: the deadline timer may be a real thread (threading not patched).
        self.hub.loop.run_callback_threadsafe(throw)

    def is_current(self) -> bool:
        import gevent

        return self.greenlet is not None and self.greenlet is gevent.getcurrent()


def greenlets_in_use() -> bool:
    """True when gevent has patched threading: bodies then run in greenlets of one hub."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("threading"))


def for_process() -> type[Interrupter]:
    return GreenletInterrupter if greenlets_in_use() else ThreadInterrupter


class SoftLimit:
    """Celery's soft time limit in a prefork child (billiard's SIGUSR1 handler, which raises
    SoftTimeLimitExceeded in whatever code runs), held back while a worker's delivery is outside its body.
    Landing in a committed claim or before a finished body's completion, it would leave a row running that
    nobody renews, and the reaper would run the job again; held, it lands as the body starts, or is logged
    when the body had already ended. It does nothing unless ``enabled`` (an eager run is inside its
    caller's time limit, which it must not swallow), nor where billiard's handler is not installed
    (threads, gevent, solo) or off the main thread."""

    def __init__(self, job_id: str | None = None, enabled: bool = False) -> None:
        self.job_id = job_id
        self._enabled = enabled
        self._handler: Any = None  # billiard's handler while held
        self._arrived = False
        self._released = False  # the body started

    def hold(self) -> None:
        if not self._enabled or self._handler is not None or SIG_SOFT_TIMEOUT is None:
            return
        if signal.getsignal(SIG_SOFT_TIMEOUT) is not soft_timeout_sighandler:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        self._handler = soft_timeout_sighandler
        signal.signal(SIG_SOFT_TIMEOUT, self._arrive)

    def _arrive(self, signum: int, frame: Any) -> None:
        self._arrived = True

    def _restore(self) -> bool:
        """Give the signal back to billiard's handler; True when one arrived while held."""
        if self._handler is None:
            return False
        # Restored first: a signal arriving from here on goes to billiard's handler itself.
        signal.signal(SIG_SOFT_TIMEOUT, self._handler)
        self._handler, arrived, self._arrived = None, self._arrived, False
        return arrived

    def release(self) -> None:
        """The body starts: a soft time limit that arrived while held is raised here, before the body's own
        code, as Celery's tracer raises one that lands before a plain task's body."""
        self._released = True
        if self._restore():
            soft_timeout_sighandler(SIG_SOFT_TIMEOUT, None)

    def end(self) -> None:
        """The run is over: a soft time limit that arrived after its body ended had nothing left to stop, and
        one that arrived before a delivery the claim did not let run had no body to stop. Nothing holds it
        again (a body's context closed late, by the garbage collector, must not)."""
        self._enabled = False
        if self._restore():
            when = "after the body ended; the run ends as its body did" if self._released else (
                "before a body started; the delivery ends as its claim decided")
            log.warning("job %s: a soft time limit (or a SIGUSR1 revoke) came %s", self.job_id, when,
                        extra={"action": "soft_limit_held"})


@contextlib.contextmanager
def soft_limit_held(job_id: str | None, enabled: bool) -> Iterator[SoftLimit]:
    """Hold Celery's soft time limit for one delivery; its lease's body lets it through while it runs."""
    soft = SoftLimit(job_id, enabled)
    soft.hold()
    try:
        yield soft
    finally:
        soft.end()


def worker_terminating() -> bool:
    """True once a cold shutdown began in this worker (Celery's own flag)."""
    from celery.worker import state

    return bool(state.should_terminate)


def worker_leaving(exc: BaseException) -> bool:
    """True when a BaseException means the worker is shutting down, not that the body failed."""
    from billiard import common
    from celery.exceptions import WorkerShutdown, WorkerTerminate
    from celery.worker import state

    if isinstance(exc, (WorkerShutdown, WorkerTerminate)) or state.should_stop or state.should_terminate:
        return True
    # A prefork child's terminate handler raises SystemExit in whatever runs; billiard flags it.
    fired = getattr(common, "terminate_handler_fired", None)
    return bool(fired is not None and fired())
