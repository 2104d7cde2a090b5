"""The helper threads' one shape: started once, woken early, stopped and joined, outliving a bad round."""

from __future__ import annotations

import sys
import threading

from celery_lease.worker.loop import Loop
from tests.helpers import wait_for


class Rounds:
    """A step that counts its rounds and returns what the test sets (seconds, or None: until a wake)."""

    def __init__(self, pause: float | None = 60.0) -> None:
        self.pause = pause
        self.count = 0
        self.raise_next = False
        self.failures: list[BaseException | None] = []

    def step(self) -> float | None:
        self.count += 1
        if self.raise_next:
            self.raise_next = False
            raise ValueError("bad round")
        return self.pause

    def failed(self) -> float | None:
        self.failures.append(sys.exc_info()[1])  # called inside the except: the traceback is there to log
        return 0.0


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_many_threads_starting_a_loop_at_once_start_one_thread() -> None:
    rounds = Rounds()
    loop = Loop("test-loop-once", rounds.step, rounds.failed)
    barrier = threading.Barrier(16)

    def first() -> None:
        barrier.wait()
        loop.start()

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # widen every race
    try:
        callers = [threading.Thread(target=first) for _ in range(16)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(10)
    finally:
        sys.setswitchinterval(previous)
    try:
        wait_for(lambda: rounds.count >= 1, timeout=5, message="the loop never ran")
        assert len(named("test-loop-once")) == 1
        assert rounds.count == 1  # one thread, one first round, then a 60 s pause
    finally:
        loop.stop()


def test_a_wake_runs_the_next_round_before_its_pause_ends() -> None:
    rounds = Rounds(pause=60.0)
    loop = Loop("test-loop-wake", rounds.step, rounds.failed)
    loop.start()
    try:
        wait_for(lambda: rounds.count == 1, timeout=5, message="no first round")
        loop.wake()
        wait_for(lambda: rounds.count == 2, timeout=5, message="the wake did not bring the round forward")
    finally:
        loop.stop()


def test_a_step_returning_none_waits_for_a_wake_and_a_delay_holds_the_first_round_back() -> None:
    rounds = Rounds(pause=None)
    loop = Loop("test-loop-none", rounds.step, rounds.failed)
    loop.start(delay=60.0)
    try:
        wait_for(lambda: loop.woken is not None and loop.thread is not None and loop.thread.is_alive(),
                 timeout=5, message="the thread did not start")
        assert rounds.count == 0  # 60 s to go
        loop.wake()
        wait_for(lambda: rounds.count == 1, timeout=5, message="the wake did not run the first round")
        loop.wake()
        wait_for(lambda: rounds.count == 2, timeout=5, message="None did not wait for the next wake")
    finally:
        loop.stop()


def test_stop_wakes_the_thread_and_joins_it() -> None:
    rounds = Rounds(pause=60.0)
    loop = Loop("test-loop-stop", rounds.step, rounds.failed)
    loop.start()
    wait_for(lambda: rounds.count == 1, timeout=5, message="no first round")
    loop.stop(timeout=5.0)
    assert loop.thread is not None and not loop.thread.is_alive()  # joined, not 60 s later
    assert rounds.count == 1 and not loop.running()


def test_a_step_that_raises_is_handed_to_failed_and_the_loop_goes_on() -> None:
    rounds = Rounds(pause=60.0)
    rounds.raise_next = True
    loop = Loop("test-loop-raise", rounds.step, rounds.failed)
    loop.start()
    try:
        # The raising round's failed() returns 0: the next round follows at once.
        wait_for(lambda: rounds.count == 2, timeout=5, message="the loop did not outlive the bad round")
        [error] = rounds.failures
        assert isinstance(error, ValueError) and str(error) == "bad round"
        assert loop.running()
    finally:
        loop.stop()


def test_a_step_that_stops_its_own_loop_ends_it_and_a_start_meanwhile_runs_a_new_thread() -> None:
    """What kept cancels and the store probe rely on: a step ends its loop under its owner's lock, and
    a start that comes while that thread winds down must not count it as running."""
    rounds = Rounds(pause=60.0)
    winding_down = threading.Event()
    loop: Loop

    def last_round() -> float | None:
        pause = rounds.step()
        loop.stop()  # from the loop's own thread: no join of itself
        if rounds.count == 1:
            winding_down.wait(10)  # the first thread is still alive when the second start comes
        return pause

    loop = Loop("test-loop-self-stop", last_round, rounds.failed)
    loop.start()
    first = loop.thread
    assert first is not None
    try:
        wait_for(lambda: rounds.count == 1, timeout=5, message="no first round")
        assert first.is_alive()
        loop.start()
        wait_for(lambda: rounds.count == 2, timeout=5, message="a thread winding down blocked the new start")
        assert loop.thread is not first
    finally:
        winding_down.set()
    first.join(5)
    assert loop.thread is not None
    loop.thread.join(5)
    assert not first.is_alive() and not loop.thread.is_alive() and rounds.failures == []
