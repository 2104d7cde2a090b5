"""What the worker's parts read of each other, named at the bottom of worker/ so none imports upward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..vocabulary import RunEnd

if TYPE_CHECKING:
    from ..config import TaskPolicy
    from ..store import Store

__all__ = ["RuntimeHandle", "LeaseHandle", "DeferredWrite"]

_T = TypeVar("_T")


@dataclasses.dataclass
class DeferredWrite:
    """A finished body's settle write the store could not take yet; ``then`` follows only a landed write."""

    end: RunEnd
    write: Callable[[], bool]
    then: Callable[[], None] | None = None
    #: Whether the first try's commit went through although its answer was lost: asked before the write is
    #: tried again, which would find the row moved on (by itself) and skip ``then``.
    landed: Callable[[], bool] | None = None


class RuntimeHandle(Protocol):
    """A worker process's runtime (runtime.Runtime) as its leases, heartbeat, timer and runs see it."""

    @property
    def store(self) -> Store: ...

    @property
    def worker(self) -> str: ...

    @property
    def hostname(self) -> str: ...

    @property
    def default_interval(self) -> float: ...

    @property
    def interval(self) -> float: ...

    @property
    def locks(self) -> Any: ...

    @property
    def timer(self) -> Any: ...

    @property
    def interrupter(self) -> Callable[[], Any]: ...

    def leases(self) -> list[Any]: ...

    def defer(self, lease: Any, write: DeferredWrite) -> None: ...

    def is_deferred(self, lease: Any) -> bool: ...

    def forget(self, lease: Any) -> None: ...

    def lost_locally(self, lease: Any, give_back: bool) -> None: ...

    def extend(self, lease: Any, seconds: float) -> bool: ...

    def give_back_lost(self) -> int: ...

    @property
    def unanswered(self) -> Any: ...

    @property
    def kept_writes(self) -> Any: ...

    def flush_deferred(self) -> None: ...

    def flush_checkpoints(self) -> None: ...


class LeaseHandle(Protocol):
    """A running job's lease (lease.Lease) as its effects and resource locks see it."""

    @property
    def job_id(self) -> str: ...

    @property
    def token(self) -> str: ...

    @property
    def worker(self) -> str: ...

    @property
    def store(self) -> Store: ...

    @property
    def policy(self) -> TaskPolicy: ...

    @property
    def runtime(self) -> RuntimeHandle: ...

    @property
    def duration(self) -> float: ...

    @property
    def lost(self) -> bool: ...

    def check(self) -> None: ...

    def mark_lost(self, reason: str, owner: str | None = None) -> None: ...

    def patiently(self, call: Callable[[], _T]) -> _T: ...

    def vanished_and_recorded_again(self) -> bool: ...

    def past_max_runtime(self, now: float) -> bool: ...

    def renewable(self, now: float) -> bool: ...

    def raising_in_body(self) -> None: ...
