"""The fault matrix's plan and verdicts: points, modes, lanes and the invariants of a settled job.

A *point* is (run kind, verb, ordinal): the n-th call of a store method or of a library
result-backend call in one run of that kind. tests/faults/points.txt lists them; every point
runs once per applicable mode in each ``make test``. A *lane* is the worker pool and store the
jobs of a mode run on: the seed picks the pool and the store (PostgreSQL or SQLite) of the
run; the matrix runs a second time on threads with lease_group_commit on (the injector attributes
a shared batch to each of its jobs). The rejection modes run on MariaDB, whose driver raises them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

from tests.faults.injector import BACKEND_MODES, REJECT_MODES, STORE_MODES

HERE = Path(__file__).resolve().parent
POINTS = HERE / "points.txt"
KNOWN_FAILING = HERE / "known_failing.txt"

KINDS = ("return", "retry0", "retry_later", "ignore", "reject_requeue", "reject_drop", "raise", "leaselost",
         "replace_task", "replace_chain", "revoke", "effects", "long", "duplicate", "started")
#: Verbs the heartbeat and the reaper call on their own clocks: only their first call is a point.
PERIODIC_VERBS = frozenset({"beat", "renew", "renew_locks", "touch_worker", "describe_loss",
                            "note_skipped_owner_alive",
                            "requeue_abandoned", "claim_abandoned", "dead_letter_abandoned", "redispatched",
                            "leases_alive"})
POINTS_HEADER = """\
# The fault matrix's points: <run kind> <verb>#<ordinal>, the n-th call of a store method (or of a
# library result-backend call) in one job of that kind. The matrix fails when a clean run makes a
# call that has no line here. "offpath <verb> <reason>": a store or backend verb no run reaches.
"""
#: Store verbs that only read: no rejection mode applies.
READ_VERBS = frozenset({"get", "kept_result", "leases_alive", "now", "describe_loss", "ensure_schema"})
BACKEND_VERBS = frozenset({"store_result", "get_state", "mark_as_retry", "mark_as_failure"})
#: Points of the ``duplicate`` kind's second delivery (sent once the job's result expired) where a
#: vanished row leaves nothing that knows the job ran: the store and the result backend both forgot
#: it. That delivery is not acknowledged away; it runs as a first delivery would, once more, to
#: SUCCESS, its link callback again (at-least-once: nothing is left to tell it from a first one).
FORGOTTEN = frozenset({"duplicate claim#2", "duplicate now#1", "duplicate get#1", "duplicate event#1",
                       "duplicate kept_result#1"})
#: Points after a job's end where a vanished row is the store forgetting a finished job: nothing brings the
#: row back (its message is acknowledged), Celery's state stands, and a dead letter read from it is not sent.
FORGOTTEN_AFTER_END = frozenset({"raise get#1", "raise event#1"})
POOLS = ("prefork", "threads")
STORES = ("postgres", "sqlite")
#: Seconds every job of the run has, after the last was published, to reach its final state.
SETTLE_BOUND = 100.0
#: Lines for the end of the pytest run (tests/faults/conftest.py prints them).
REPORT: list[str] = []


@dataclasses.dataclass(frozen=True, order=True)
class Point:
    kind: str
    verb: str
    ordinal: int

    def __str__(self) -> str:
        return f"{self.kind} {self.verb}#{self.ordinal}"

    @classmethod
    def parse(cls, text: str) -> Point:
        kind, call = text.split()
        verb, ordinal = call.split("#")
        return cls(kind, verb, int(ordinal))


def read_points(path: Path = POINTS) -> tuple[list[Point], dict[str, str]]:
    """The points, and the verbs no run kind reaches (``offpath VERB reason``)."""
    points, offpath = [], {}
    for line in path.read_text().splitlines():
        line = line.split("  #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("offpath "):
            _, verb, reason = line.split(None, 2)
            offpath[verb] = reason
        else:
            points.append(Point.parse(line))
    return points, offpath


def modes_of(point: Point) -> tuple[str, ...]:
    if point.verb in BACKEND_VERBS:
        return BACKEND_MODES
    if point.verb in READ_VERBS:
        return STORE_MODES
    return STORE_MODES + REJECT_MODES


def pair_name(point: Point, mode: str) -> str:
    return f"{point} {mode}"


def read_known_failing(store: str | None = None,
                       path: Path = KNOWN_FAILING) -> tuple[dict[str, str], set[str]]:
    """(pair -> the invariant it breaks, pairs that fail only some of the time) for a run whose main
    lane is on ``store``: a line tagged ``[sqlite]`` or ``[postgres]`` applies on that store only,
    one tagged ``flaky`` is expected to fail sometimes and never fails the run."""
    known, flaky = {}, set()
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pair, _, why = line.partition("  # ")
        pair, tags = pair.strip(), set()
        if pair.endswith("]"):
            pair, _, tag = pair[:-1].rpartition(" [")
            tags = set(tag.split())
        if store is not None and tags & set(STORES) and store not in tags:
            continue
        if "flaky" in tags:
            flaky.add(pair)
        else:
            known[pair] = why.strip()
    return known, flaky


def lane_of(seed: int, group_commit: bool = False) -> tuple[str, str]:
    """(pool, store) of the run's non-rejection lane: the seed rotates through the four pairs. A run
    with lease_group_commit is on threads (a prefork child never has two writes to share)."""
    return ("threads" if group_commit else POOLS[seed % 2]), STORES[(seed // 2) % 2]


def overlaps(bodies: list[dict[str, Any]]) -> bool:
    spans = sorted((b["start"], b["end"]) for b in bodies)
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


@dataclasses.dataclass
class Outcome:
    """What a job ended as: the store's status, Celery's state and result, and what its bodies did."""

    status: str | None
    state: str
    result: Any
    bodies: list[dict[str, Any]]
    effects: int
    linked: int
    fired: str | None
    #: Whether the audit says an effect block ended by its lost lease kept its key (effect_unconfirmed):
    #: the one case where a finished job may not have done its effect.
    unconfirmed: bool = False
    #: Messages of the job in the lane's dead-letter queue.
    dead_letters: int = 0

    @classmethod
    def read(cls, job_id: str, store: Any, app: Any, r: Any) -> Outcome:
        job = store.get(job_id)
        res = app.AsyncResult(job_id)
        state = res.state
        result = res.result
        if isinstance(result, BaseException):
            result = type(result).__name__
        bodies = [json.loads(b) for b in r.lrange(f"faults:body:{job_id}", 0, -1)]
        fired = r.get(f"faults:fired:{job_id}")
        unconfirmed = bool(store.reports.events(job_id, "effect_unconfirmed"))
        dead_letters = sum(json.loads(m)["headers"]["id"] == job_id
                           for m in r.lrange(app.conf.lease_dead_letter_queue, 0, -1))
        return cls(job.status if job else None, state, result, bodies,
                   int(r.get(f"faults:effect:{job_id}:k1") or 0), int(r.get(f"faults:linked:{job_id}") or 0),
                   fired.decode() if fired else None, unconfirmed, dead_letters)


def forgotten(point: Point | None, mode: str) -> bool:
    """Whether the pair's fault makes the store forget a finished job (see FORGOTTEN)."""
    return mode == "vanished" and point is not None and str(point) in FORGOTTEN


def forgotten_after_end(point: Point | None, mode: str) -> bool:
    """Whether the pair's fault deletes the row of a job already finished (see FORGOTTEN_AFTER_END)."""
    return mode == "vanished" and point is not None and str(point) in FORGOTTEN_AFTER_END


def broken(outcome: Outcome, clean: Outcome, mode: str, point: Point | None = None) -> list[str]:
    """The invariants ``outcome`` breaks, against the clean run of the same kind."""
    faults = []
    rejected = mode in REJECT_MODES
    runs = 1
    if forgotten(point, mode):
        assert point is not None
        clean, runs = dataclasses.replace(clean, state="SUCCESS", result=f"ok:{point.kind}"), 2
    if outcome.status in ("running", "pending"):
        faults.append(f"not settled: store status {outcome.status}")
    elif outcome.status is None and forgotten_after_end(point, mode):
        pass  # the fault deleted the finished job's row: Celery's state and the runs are still judged
    elif outcome.status is None and clean.status is not None:
        faults.append("the job's row is gone")
    elif outcome.status != clean.status and not (rejected and outcome.status == "failed"):
        faults.append(f"store status {outcome.status}, clean run {clean.status}")
    if outcome.state != clean.state and not (rejected and outcome.state == "FAILURE"):
        faults.append(f"Celery state {outcome.state}, clean run {clean.state}")
    elif outcome.state == clean.state == "SUCCESS" and outcome.result != clean.result:
        faults.append(f"result {outcome.result!r}, clean run {clean.result!r}")
    if overlaps(outcome.bodies):
        faults.append("two bodies of the job overlapped")
    if sum(b["done"] for b in outcome.bodies) > runs:
        faults.append(f"the body reached its end {sum(b['done'] for b in outcome.bodies)} times")
    if outcome.effects > 1:
        faults.append(f"effect k1 ran {outcome.effects} times")
    elif outcome.effects < clean.effects and outcome.status == "completed" and not outcome.unconfirmed:
        faults.append("effect k1 never ran, yet its job completed and nothing audited it unconfirmed")
    if outcome.status == clean.status and outcome.dead_letters != clean.dead_letters:
        faults.append(f"{outcome.dead_letters} dead letters, clean run {clean.dead_letters}")
    if outcome.linked > runs:
        faults.append(f"the link callback ran {outcome.linked} times")
    return faults
