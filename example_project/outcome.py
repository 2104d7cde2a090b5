"""The demo's final table and the guarantees checked against what the run recorded.

Executions and effects are counted from the tasks' own records (executions table, the
card processor's captures, the shop's tables); deliveries skipped and stale writes from
the lease store's audit log, which plain Celery does not have.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from .scenario import Record, recovery_bound
from .tracking import FINISHED

__all__ = ["Check", "Table", "tabulate", "check", "COLUMNS", "SCHEDULING_SLACK"]

# Seconds a recovery may take beyond the recovery bound on a busy two-core machine:
# beat's tick, the reaper worker's broker poll and process scheduling.
SCHEDULING_SLACK = 2.5
COLUMNS = ("mode", "jobs published", "completed", "executions", "duplicate deliveries skipped",
           "stale writes rejected", "effects recorded", "lost")


@dataclasses.dataclass(frozen=True)
class Table:
    mode: str
    published: int
    completed: int
    executions: int
    duplicates_skipped: int
    stale_rejected: int
    effects: int
    lost: int
    failed: int

    def row(self) -> tuple[object, ...]:
        return (self.mode, self.published, self.completed, self.executions, self.duplicates_skipped,
                self.stale_rejected, self.effects, self.lost)

    def markdown(self) -> list[str]:
        return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
                "| " + " | ".join(str(v) for v in self.row()) + " |"]


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: not applicable in this mode
    detail: str


def _finished(rec: Record) -> Counter[str]:
    return Counter(r["job_id"] for r in rec.executions if r["outcome"] == FINISHED)


def _stale_events(rec: Record) -> list[dict]:
    return [e for e in rec.events if e["event"] == "lease_lost"
            or (e["event"].startswith("stale_") and e["event"].endswith("_rejected"))]


def tabulate(rec: Record) -> Table:
    finished = _finished(rec)
    if rec.mode == "lease":
        completed = sum(1 for j in rec.jobs if rec.statuses.get(j.job_id) == "completed")
        failed = sum(1 for j in rec.jobs if rec.statuses.get(j.job_id) == "failed")
    else:
        completed = sum(1 for j in rec.jobs if finished[j.job_id])
        ended = {r["job_id"] for r in rec.executions if r["outcome"] not in (None, FINISHED)}
        failed = sum(1 for j in rec.jobs if not finished[j.job_id] and j.job_id in ended)
    effects = sum(rec.captures.values()) + rec.issued.get("invoices", 0) + rec.issued.get("reports", 0)
    return Table(
        mode=rec.mode, published=len(rec.jobs), completed=completed, executions=len(rec.executions),
        duplicates_skipped=sum(1 for e in rec.events if e["event"] == "duplicate_delivery_skipped"),
        stale_rejected=len(_stale_events(rec)), effects=effects,
        lost=len(rec.jobs) - completed - failed, failed=failed,
    )


def _recovery(rec: Record) -> Check:
    bound = recovery_bound()
    if not rec.settled:
        return Check("no job stuck", False, "jobs were still unfinished at the demo's deadline")
    notes, ok = [], True
    for d in rec.disruptions:
        what = "its worker was killed" if d.kind == "kill" else "its worker froze"
        if rec.mode == "plain":
            if d.kind == "kill":
                ran_again = any(r["job_id"] == d.job_id and r["started_at"] > d.at for r in rec.executions)
                notes.append(f"{d.label} {'ran again' if ran_again else 'never ran again'} after {what}")
                ok = ok and ran_again
            else:
                notes.append(f"{d.label} waited {(d.resumed_at or d.at) - d.at:.1f}s for its frozen worker: "
                             "nothing takes a job back from a hung worker, however long it hangs")
                ok = False
            continue
        reaped = [e["at"] for e in rec.events
                  if e["job_id"] == d.job_id and e["event"] == "reaped_expired_lease" and e["at"] >= d.at]
        if not reaped:
            notes.append(f"{d.label} was never taken back after {what}")
            ok = False
            continue
        delay = min(reaped) - d.at
        ok = ok and delay <= bound + SCHEDULING_SLACK
        notes.append(f"{d.label} taken back {delay:.1f}s after {what}")
    limit = f" (bound: lease+grace+reaper+heartbeat = {bound:g}s, +{SCHEDULING_SLACK:g}s scheduling slack)"
    return Check("no job stuck", ok, "; ".join(notes) + (limit if rec.mode == "lease" else ""))


def _once(rec: Record, table: Table) -> list[Check]:
    finished = _finished(rec)
    fenced = {(e["token"] or "") for e in _stale_events(rec)}
    live_finishes = Counter(r["job_id"] for r in rec.executions
                            if r["outcome"] == FINISHED and (r["token"] or "") not in fenced)
    twice = sorted(rec.label(j) for j, n in live_finishes.items() if n > 1)
    body = Check("no body ran twice to completion", not twice,
                 f"{sum(finished.values())} bodies finished for {len(finished)} jobs"
                 + (f"; twice: {', '.join(twice)}" if twice else ""))
    charged = {label: n for label, n in rec.captures.items() if n > 1}
    payments = [j for j in rec.jobs if j.task == "capture_payment"]
    unpaid = [j.label for j in payments if finished[j.job_id] and not rec.captures.get(j.label)]
    orphan = [j.label for j in payments if rec.captures.get(j.label) and not finished[j.job_id]]
    detail = (f"{sum(rec.captures.values())} card captures for {len(payments)} payments, "
              f"{rec.issued.get('invoices', 0)} invoices, {rec.issued.get('reports', 0)} reports")
    if charged:
        detail += "; charged more than once: " + ", ".join(f"{k} x{v}" for k, v in sorted(charged.items()))
    if unpaid:
        detail += "; completed without a capture: " + ", ".join(unpaid)
    if orphan:
        detail += "; charged but never completed: " + ", ".join(orphan)
    effects = Check("effects once per key", not charged and not unpaid and not orphan, detail)
    return [body, effects]


def _fenced(rec: Record) -> Check:
    stops = [d for d in rec.disruptions if d.kind == "stop"]
    if rec.mode == "plain":
        return Check("stale owners fenced", None, "no lease, so a frozen worker stays the owner: "
                     + ", ".join(f"{d.node} resumed {d.label} where it stopped" for d in stops))
    notes, ok = [], True
    for d in stops:
        run = next((r for r in rec.executions if r["id"] == d.execution_id), None)
        mine = [e for e in rec.events if e["job_id"] == d.job_id and (e["token"] or "") == d.token]
        stale = [e for e in _stale_events(rec) if e in mine]
        completed_by_it = any(e["event"] == "completed" for e in mine)
        ok = ok and bool(stale) and not completed_by_it
        notes.append(f"{d.node} woke up owning nothing: {len(stale)} write(s) rejected "
                     f"({', '.join(sorted({e['event'] for e in stale})) or 'none'}), "
                     f"its run of {d.label} ended {run['outcome'] if run else 'unrecorded'}"
                     + ("; its completion was ACCEPTED" if completed_by_it else ""))
    return Check("stale owners fenced", ok, "; ".join(notes))


def check(rec: Record, table: Table) -> list[Check]:
    """The guarantees this run exercised, each with what the run showed."""
    lost = Check("no job lost", table.lost == 0 and table.failed == 0,
                 f"{table.completed} of {table.published} jobs completed, "
                 f"{table.failed} dead-lettered or failed, {table.lost} lost")
    return [lost, _recovery(rec), *_once(rec, table), _fenced(rec)]
