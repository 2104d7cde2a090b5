"""The fault matrix's list of points covers every call a worker makes of the store and the backend.

A store method added to the worker's surface (the engine's own calls and those of the worker's
statement groups, WORKER_GROUPS), or a result-backend call added to the adapter
(celery_lease/backend.py), fails here until points.txt gives it a point or says why no run reaches
it (``offpath``). The matrix itself (test_matrix.py) fails when a clean run makes a call
of a verb that its kind has no point for.
"""

from __future__ import annotations

import inspect

from celery_lease.messaging import backend
from celery_lease.store import (
    DeliveryStatements,
    EffectStatements,
    JobStatements,
    PublishStatements,
    ReplaceStatements,
    StoreEngine,
    WorkerStatements,
)
from tests.faults import matrix
from tests.faults.injector import MODES, VERBS

#: The statement groups a worker process calls (store.publishes, .jobs, .replacing, .workers,
#: .effects, .deliveries); the reaper's and the operators' are not on a run's path.
WORKER_GROUPS = (PublishStatements, JobStatements, ReplaceStatements, WorkerStatements, EffectStatements,
                 DeliveryStatements)


def _worker_verbs() -> set[str]:
    return {name for cls in (StoreEngine, *WORKER_GROUPS) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))}


def test_every_worker_store_call_and_backend_call_has_a_point_or_a_reason():
    points, offpath = matrix.read_points()
    covered = {p.verb for p in points} | set(offpath)
    missing = sorted((_worker_verbs() | set(backend.VERBS)) - covered)
    assert not missing, f"store or backend calls with no point in points.txt and no offpath reason: {missing}"


def test_every_point_names_a_store_method_or_a_backend_call_of_a_known_run_kind():
    points, offpath = matrix.read_points()
    unknown = sorted(str(p) for p in points
                     if p.kind not in matrix.KINDS or p.verb not in VERBS | set(backend.VERBS))
    assert not unknown, f"points naming no run kind, store method or backend call: {unknown}"
    assert not set(offpath) & {p.verb for p in points}, "a verb is both a point and off every run's path"


def test_the_backend_adapter_passes_every_call_the_library_makes():
    adapter = {n for n, v in vars(backend.Injected).items()
               if not n.startswith("_") and inspect.isfunction(v)}
    assert adapter == set(backend.VERBS) == matrix.BACKEND_VERBS


def test_every_known_failing_pair_is_a_pair_the_matrix_runs():
    points, _ = matrix.read_points()
    pairs = {matrix.pair_name(p, m) for p in points for m in matrix.modes_of(p)}
    clean = {f"{kind} clean_run#0 clean" for kind in matrix.KINDS}
    known, flaky = matrix.read_known_failing()
    listed = set(known) | flaky
    assert listed <= pairs | clean, sorted(listed - pairs - clean)
    assert all(m in MODES for p in points for m in matrix.modes_of(p))
