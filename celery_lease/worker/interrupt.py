"""Raising LeaseLost inside a running body: an asynchronous exception for an OS thread, a throw from its hub
for a gevent greenlet; both land when the body next runs Python code. A store call in ``uninterrupted()``
defers it to the call's end, so no lock or pooled connection is left astray."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..context import BODY
from ..errors import LeaseLost
from ..store.base import uninterrupted

__all__ = ["Interrupter", "ThreadInterrupter", "GreenletInterrupter", "raise_in_thread", "for_process",
           "uninterrupted", "BODY"]


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
