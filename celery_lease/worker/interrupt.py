"""Raising LeaseLost inside a running body: an asynchronous exception for an OS thread, a throw from its hub
for a gevent greenlet; both land when the body next runs Python code. A store call in ``uninterrupted()``
defers it to the call's end, so no lock or pooled connection is left astray."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import LeaseLost
from ..shield import BODY, uninterrupted

__all__ = ["Interrupter", "ThreadInterrupter", "GreenletInterrupter", "raise_in_thread", "for_process",
           "uninterrupted", "BODY"]


def raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> bool:
    """Raise ``exc_type`` asynchronously in a thread (None clears a pending one)."""
    count = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None
    )
    return count == 1


def _async_error(error: LeaseLost) -> type[LeaseLost]:
    # The interpreter instantiates an asynchronous exception with no arguments.
    job_id, reason, owner = error.job_id, error.reason, error.owner

    def __init__(self: LeaseLost) -> None:
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

    def bind(self) -> None:
        self.thread_id = threading.get_ident()

    def interrupt(self, error: LeaseLost, still_running: Callable[[], bool]) -> None:
        # The body's own thread found the loss: it raises LeaseLost itself (check()).
        if self.thread_id is not None and self.thread_id != threading.get_ident() and still_running():
            raise_in_thread(self.thread_id, _async_error(error))

    def cancel(self) -> None:
        if self.thread_id is not None:
            raise_in_thread(self.thread_id, None)

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
