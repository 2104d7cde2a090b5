"""The vocabulary: every audit event written is an Event, every Event is written, and the lists
that metrics, the CLI, the checks and the README and docs/ pages name are made of its members."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

from celery_lease import vocabulary
from celery_lease.cli import reads
from celery_lease.config import SETTINGS
from celery_lease.ops import check_context, metrics
from celery_lease.store import schema
from celery_lease.vocabulary import (
    STALE_WRITES,
    CancelReason,
    ClaimOutcome,
    DeadLetterAction,
    Decision,
    EffectOutcome,
    Event,
    OnLost,
    RecoveryAction,
    RunMode,
    Severity,
    Status,
    StoreFailure,
    WorkerLostOutcome,
    stale_write,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_lease"
#: Functions that write an audit event name: the positional index and keyword of each event argument.
WRITERS: dict[str, tuple[tuple[int, str], ...]] = {
    "event": ((1, "event"),),  # StoreEngine.event(job_id, event, ...)
    "_event": ((2, "event"),),  # StoreEngine._event(conn, job_id, event, ...)
    "_audited": ((2, "event"),),
    "_audited_row": ((2, "event"),),
    "_audited_write": ((2, "event"),),
    "_build_audited": ((1, "event"),),
    "_record_statements": ((1, "event_name"),),  # PublishStatements: the publish record's event
    "_owner_write": ((3, "event"), (4, "stale")),
    "_stale": ((2, "event"),),  # StoreEngine._stale(conn or None, job_id, event, ...)
    "_take_back": ((7, "event"),),
    "_audit": ((2, "event"),),  # deliveries._audit(store, job_id, event, ...)
    "release": ((3, "reason"),),  # JobStatements.release: the reason is the event
    "give_back": ((0, "reason"),),
    "release_all": ((0, "reason"),),
    "_release_held": ((0, "reason"),),
}


def _sources() -> list[tuple[pathlib.Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _event_arguments() -> list[tuple[str, ast.expr]]:
    """(where, expression) of every event argument of a writer call and of a writer's default."""
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                for index, keyword in WRITERS.get(name, ()):
                    kw = [k.value for k in node.keywords if k.arg == keyword]
                    arg = kw[0] if kw else (node.args[index] if index < len(node.args) else None)
                    if arg is not None:
                        found.append((f"{path.relative_to(ROOT)}:{node.lineno} {name}()", arg))
            elif isinstance(node, ast.FunctionDef) and node.name in WRITERS:
                params = node.args.args[-len(node.args.defaults):] if node.args.defaults else []
                for param, default in zip(params, node.args.defaults, strict=True):
                    if param.arg in {kw for _, kw in WRITERS[node.name]}:
                        found.append((f"{path.relative_to(ROOT)}:{node.lineno} def {node.name}", default))
    return found


def _members(expr: ast.expr) -> set[str]:
    return {n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "Event"}


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def test_every_event_writer_is_given_an_event_member_never_a_string_literal():
    arguments = _event_arguments()
    assert len(arguments) > 40, "the scan no longer finds the writers: update WRITERS"
    literals = [where for where, arg in arguments
                if any(_is_text(n)
                       for n in ast.walk(arg))]
    assert literals == []


def test_every_event_member_is_written_somewhere():
    written = set().union(*(_members(arg) for _, arg in _event_arguments()))
    assert {e.name for e in Event} - written == set()


def test_lists_of_metrics_cli_and_checks_are_event_members():
    named = [*metrics.EVENT_NAMES, *(e for *_, events in metrics.COUNTERS for e in events),
             *reads.LAST_HOUR, *check_context.RECOVERY_EVENTS, *vocabulary.STALE_WRITES, *vocabulary.RELEASES,
             *vocabulary.RECOVERIES, *vocabulary.MANUAL_RECOVERIES, *vocabulary.REPLACEMENTS]
    assert [n for n in named if not isinstance(n, Event)] == []
    assert set(STALE_WRITES) == {e for e in Event if e.value.startswith("stale_")}


def test_metrics_cli_and_checks_name_no_event_by_a_literal_of_their_own():
    # "completed" and "failed" are statuses as well, and name columns and report keys there.
    values = {e.value for e in Event} - {s.value for s in Status}
    modules = [PACKAGE / "ops/metrics.py", PACKAGE / "ops/checks.py", PACKAGE / "ops/check_context.py",
               PACKAGE / "ops/checklist.py", *PACKAGE.glob("cli/*.py")]
    literals = [f"{p.name}:{n.lineno} {n.value}" for p in modules for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Constant) and n.value in values]
    assert literals == []


def test_statuses_of_the_schema_and_the_cli_are_the_status_members():
    assert schema.STATUSES == tuple(s.value for s in Status) == reads.STATUSES


def test_the_stale_write_label_is_the_write_the_event_names():
    assert [stale_write(e) for e in STALE_WRITES] == [
        "completion", "failure", "retry", "release", "checkpoint", "effect", "lock"]
    with pytest.raises(ValueError):
        stale_write(Event.LOCK_LOST)


@pytest.mark.parametrize("enum", [Status, ClaimOutcome, EffectOutcome, Decision, RecoveryAction, Event,
                                  WorkerLostOutcome, OnLost, StoreFailure, RunMode, Severity,
                                  DeadLetterAction, CancelReason])
def test_a_member_is_its_stored_string_in_comparisons_formatting_and_json(enum):
    for member in enum:
        assert member == member.value and hash(member) == hash(member.value)
        assert str(member) == f"{member}" == format(member, "s") == member.value
        assert json.loads(json.dumps({"x": member})) == {"x": member.value}
        assert enum(member.value) is member


def _readme_names() -> set[str]:
    text = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    return (set(re.findall(r"`([a-z][a-z0-9_]*)`", text))
            | set(re.findall(r"--event[ =]([a-z][a-z0-9_]*)", text)))


def test_event_names_in_the_readme_are_event_members():
    # An event-shaped name ends like some event (…_rejected, …_lost, …_skipped) and is not a
    # setting, a metric or another vocabulary word: a misspelt or retired event name fails here.
    events = {e.value for e in Event}
    others = {m.value for enum in (Status, ClaimOutcome, EffectOutcome, Decision, RecoveryAction)
              for m in enum}
    settings = {s.name for s in SETTINGS}
    # Log records' actions (extra={"action": ...}) are the log's vocabulary, not events.
    actions = {m for path, _ in _sources() for m in re.findall(r'"action": "([a-z_]+)"', path.read_text())}
    from celery.app.defaults import DEFAULTS

    from celery_lease.ops.celery_settings import FEATURES

    # Celery's own settings, those of later Celery versions than the installed one included.
    celery_settings = set(DEFAULTS) | {setting for setting, _, _ in FEATURES}
    # lease check's finding names (Finding(OK, "beat_alive", ...)) are the check's vocabulary.
    findings = {m for path, _ in _sources() for m in re.findall(r'Finding\(\s*[A-Z_]+,\s*"([a-z_]+)"',
                                                                 path.read_text())}
    endings = {e.rsplit("_", 1)[-1] for e in events}
    names = _readme_names()
    shaped = {n for n in names - events - others - settings - actions - findings
              - celery_settings
              if "_" in n and not n.startswith("celery_lease_") and n.rsplit("_", 1)[-1] in endings}
    assert shaped == set()
    assert {"reaped_expired_lease", "duplicate_delivery_skipped", "stale_effect_rejected"} <= names & events
