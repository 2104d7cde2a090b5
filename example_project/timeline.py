"""The demo's timeline: second by second, the lease table, the reaper, each worker and the demo.

It merges three sources: the store's audit log (events), the executions the tasks
recorded themselves, and the demo's own actions. Routine store events (claims,
checkpoints, completions) are shown through the executions they belong to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from .scenario import Record

__all__ = ["render", "short_worker"]

WORKER_ID = re.compile(r"\b([\w.-]+)@[\w.-]+(?::\d+)?")
ROUTINE = {"published", "claimed", "checkpoint", "completed", "retry_scheduled"}
REAPER = {"reaped_expired_lease", "reap_skipped_owner_alive", "redispatched", "dead_lettered"}
NOTABLE_PHASES = ("captured", "capture already done", "already issued", "already stored", "resumed at")
STATUS_ORDER = ("pending", "running", "completed", "failed")


def short_worker(text: str | None) -> str:
    """``w1@host:4242`` -> ``w1``, wherever it appears in ``text``."""
    return WORKER_ID.sub(r"\1", text or "")


def _detail(event: dict) -> dict:
    try:
        detail = json.loads(event.get("detail") or "{}")
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


def _event_line(rec: Record, event: dict) -> tuple[str, str]:
    """(actor, text) for one store event that is not routine."""
    name, label = event["event"], rec.label(event["job_id"])
    worker, reason = short_worker(event["worker"]), short_worker(event["reason"])
    if name == "reaped_expired_lease":
        delay = (_detail(event).get("delay") or 0.0)
        return "reaper", f"{label}: {reason} -> pending again, re-published with {delay:.1f}s backoff"
    if name == "reap_skipped_owner_alive":
        return "reaper", f"{label}: lease expired but owner {worker} is alive; left alone ({reason})"
    if name == "redispatched":
        return "reaper", f"{label}: message lost, published again ({reason})"
    if name == "dead_lettered":
        return "reaper", f"{label}: dead-lettered ({reason})"
    if name == "lease_lost":
        return worker or "store", f"heartbeat: renewal of {label} rejected, the lease moved on ({reason})"
    if name.startswith("stale_") and name.endswith("_rejected"):
        write = name[len("stale_"):-len("_rejected")]
        return worker or "store", f"{write} of {label} rejected: stale lock token"
    if name == "duplicate_delivery_skipped":
        return worker or "store", f"duplicate delivery of {label} skipped ({reason})"
    if name == "lease_taken_over":
        return worker or "store", f"took over the expired lease of {label}"
    who = worker or "store"
    return who, f"{name} {label}" + (f" ({reason})" if reason else "")


def _items(rec: Record) -> Iterable[tuple[float, str, str]]:
    """(time, actor, text) of everything worth a line."""
    for action in rec.actions:
        yield action.at, "demo", action.text
    runs = {r["id"]: r for r in rec.executions}
    for run in rec.executions:
        attempt = f" (attempt {run['attempt']})" if run["attempt"] and run["attempt"] > 1 else ""
        yield run["started_at"], run["node"], f"started {run['label']}{attempt}"
        if run["finished_at"] is not None:
            if run["outcome"] == "finished":
                text = f"finished {run['label']}"
            elif run["outcome"] == "LeaseLost":
                text = f"{run['label']} stopped by LeaseLost (the lease moved on)"
            else:
                text = f"{run['label']} ended with {run['outcome']}"
            yield run["finished_at"], run["node"], text
    for phase in rec.phases:
        run = runs.get(phase["execution_id"])
        if run and phase["phase"].startswith(NOTABLE_PHASES):
            text = "card charged" if phase["phase"] == "captured" else phase["phase"]
            if phase["phase"] == "capture already done":
                text = "capture already recorded: card not charged again"
            yield phase["at"], run["node"], f"{run['label']}: {text}"
    for event in rec.events:
        if event["event"] not in ROUTINE:
            actor, text = _event_line(rec, event)
            yield event["at"], actor, text


def _state(rec: Record, second: int, previous: str) -> str:
    """The lease table and the running jobs at the end of ``second``."""
    window = [s for s in rec.samples if s.at - rec.t0 < second + 1]
    if not window:
        return previous
    sample = window[-1]
    parts = []
    if sample.statuses:
        parts.append("store " + " · ".join(f"{sample.statuses[k]} {k}" for k in STATUS_ORDER
                                           if sample.statuses.get(k)))
    frozen = {d.node for d in rec.disruptions
              if d.kind == "stop" and d.at <= sample.at < (d.resumed_at or rec.ended_at)}
    entries = [(node, f"{node} {label}" + (" (frozen)" if node in frozen else ""))
               for node, label in sample.running]
    # A killed worker's job stays "running" until someone takes it back: show the zombie.
    for d in rec.disruptions:
        taken_back = min([e["at"] for e in rec.events if e["job_id"] == d.job_id
                          and e["event"] == "reaped_expired_lease" and e["at"] >= d.at] or [rec.ended_at])
        if d.kind == "kill" and d.at <= sample.at < taken_back:
            entries.append((d.node, f"{d.node} {d.label} (dead)"))
    running = ", ".join(text for _, text in sorted(entries)) or "nothing"
    parts.append(f"running: {running}")
    return "   ".join(parts)


def render(rec: Record) -> list[str]:
    """The timeline as lines of text, one block per second from the first publish to the end."""
    by_second: dict[int, list[tuple[float, str, str]]] = {}
    for at, actor, text in _items(rec):
        by_second.setdefault(max(0, int(at - rec.t0)), []).append((at, actor, text))
    last = max([int(rec.ended_at - rec.t0), *by_second]) if rec.t0 else 0
    lines: list[str] = []
    state = ""
    for second in range(last + 1):
        state = _state(rec, second, state)
        lines.append(f"{second:>4}s  {state}")
        items = sorted(by_second.get(second, []))
        actors: list[str] = []
        for _, actor, _ in items:
            if actor not in actors:
                actors.append(actor)
        for actor in actors:
            texts = [text for _, who, text in items if who == actor]
            if actor in ("demo", "reaper") or any("stale" in t or "lease" in t.lower() for t in texts):
                lines.extend(f"        {actor:<7} {text}" for text in texts)
            else:
                lines.append(f"        {actor:<7} " + " · ".join(texts))
    return lines
