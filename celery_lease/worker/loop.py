"""Loop: the one shape of the worker's helper threads (heartbeat, deadline timer, kept cancels, visibility
refresher, store probe). A step that raises goes to ``failed`` inside the ``except`` (so it can log the
traceback): one bad round never ends the thread. A forked child sees the parent's thread dead, so its first
start starts its own; ``threading`` is looked up at each start, so under gevent the loop is a greenlet of
the hub."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Loop", "Step"]

Step = Callable[[], "float | None"]  # a round: the seconds until the next one (None: until a wake)


class _Run:
    """One started thread with its own stop flag and wake-up event, so a thread winding down after ``stop()``
    never eats a wake meant for its successor."""

    def __init__(self, name: str, delay: float | None, target: Callable[[_Run], None]) -> None:
        self.stopping = threading.Event()
        self.woken = threading.Event()
        self.delay = delay
        self.thread = threading.Thread(target=target, args=(self,), name=name, daemon=True)


class Loop:
    """A named daemon thread calling ``step`` every time it returns, until ``stop()``."""

    def __init__(self, name: str, step: Step, failed: Step) -> None:
        self.name = name
        self._step = step
        self._failed = failed
        self._starting = threading.Lock()
        self._run: _Run | None = None

    @property
    def thread(self) -> threading.Thread | None:
        run = self._run
        return run.thread if run is not None else None

    @property
    def woken(self) -> threading.Event | None:
        """The running thread's wake-up event, set until its next round begins (tests read it)."""
        run = self._run
        return run.woken if run is not None else None

    def running(self) -> bool:
        run = self._run
        return run is not None and run.thread.is_alive() and not run.stopping.is_set()

    def start(self, delay: float | None = 0.0) -> None:
        """Start the thread unless it runs (one starts, however many threads ask; one told to stop does not
        count); its first round comes after ``delay`` seconds."""
        with self._starting:
            if self.running():
                return
            self._run = _Run(self.name, delay, self._loop)
            self._run.thread.start()

    def wake(self) -> None:
        """Run the next round now (or as soon as the one under way ends)."""
        run = self._run
        if run is not None:
            run.woken.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Tell the thread to stop, wake it and wait for it (from the loop's own thread, only tell)."""
        run = self._run
        if run is None:
            return
        run.stopping.set()
        run.woken.set()
        if run.thread is not threading.current_thread():
            run.thread.join(timeout)

    def _loop(self, run: _Run) -> None:
        pause = run.delay
        while True:
            run.woken.wait(pause)
            run.woken.clear()
            if run.stopping.is_set():
                return
            try:
                pause = self._step()
            except Exception:  # noqa: BLE001 - the thread must outlive any one bad round
                pause = self._failed()
