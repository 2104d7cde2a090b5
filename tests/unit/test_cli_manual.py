"""`celery lease requeue | dlq redrive | dlq discard | effects forget`: plan, dry run, confirmation.

Each verb shows its plan; ``--dry-run`` stops there; a terminal is asked; a script without a
terminal gets the plan and a non-zero exit unless it says ``--yes``. Job ids may be given as
a unique prefix. On SQLite and PostgreSQL, publishing to the in-memory broker.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from tests.apps import ops_app
from tests.conftest import SCENE_STORES
from tests.unit.test_cli import Scene, _url, scene


@pytest.fixture(params=SCENE_STORES)
def fresh(request, tmp_path_factory) -> Iterator[Scene]:
    with scene(_url(request.param, tmp_path_factory), "memory://") as s:
        yield s


@pytest.fixture
def terminal(monkeypatch):
    """An operator at a terminal, who will answer the confirmation question."""
    monkeypatch.setattr("celery_lease.cli.manual.can_prompt", lambda: True)


def statuses(s: Scene, ids: list[str]) -> dict[str, str | None]:
    return {job_id: getattr(s.store.get(job_id), "status", None) for job_id in ids}


# -- the plan, --dry-run, --yes and the question ------------------------------------------
@pytest.mark.parametrize("args", [
    ("requeue", "--expired"), ("dlq", "redrive"), ("dlq", "discard"), ("effects", "forget", "paid:1"),
])
def test_a_dry_run_prints_the_plan_and_changes_nothing(fresh, args):
    fresh.store.effects.record_effect("paid:1", "abandoned-0", fresh.store.get("abandoned-0").lock_token)
    before = fresh.store.reports.list_jobs(limit=1000)
    result = fresh.run(*args, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "abandoned-2" in result.output or "failed-0" in result.output or "paid:1" in result.output
    plan = json.loads(fresh.run(*args, "--dry-run", "--json").stdout)
    assert plan["dry_run"] is True and plan["planned"]
    assert fresh.store.reports.list_jobs(limit=1000) == before
    assert fresh.store.reports.effect_record("paid:1") is not None


@pytest.mark.parametrize("args", [("requeue", "--expired"), ("dlq", "redrive"), ("dlq", "discard")])
def test_without_a_terminal_and_without_yes_the_plan_is_printed_and_the_exit_is_non_zero(fresh, args):
    before = fresh.store.reports.list_jobs(limit=1000)
    result = fresh.run(*args)
    assert result.exit_code == 1
    assert "job" in result.stdout.splitlines()[0]  # the plan's table
    assert "nobody confirmed: nothing changed" in result.stderr and "--yes" in result.stderr
    assert fresh.store.reports.list_jobs(limit=1000) == before


def test_a_terminal_is_asked_and_no_means_nothing_changes(fresh, terminal):
    result = fresh.run_input("n\n", "requeue", "--expired")
    assert result.exit_code == 1 and "Requeue" not in result.stdout
    assert "requeue 3 job(s)?" in result.output
    assert set(statuses(fresh, fresh.ids["abandoned"]).values()) == {"running"}


def test_a_terminal_that_says_yes_requeues(fresh, terminal):
    result = fresh.run_input("y\n", "requeue", "--expired")
    assert result.exit_code == 0, result.output
    assert "requeued 3," in result.stdout
    assert set(statuses(fresh, fresh.ids["abandoned"]).values()) == {"pending"}


def test_the_batch_defaults_to_ten(fresh):
    for i in range(12):
        fresh.store.publishes.record(f"more-{i}", "ops.fails", "celery", None, 3)
        fresh.store.jobs.cancel(f"more-{i}", "revoked")
    plan = json.loads(fresh.run("dlq", "discard", "--dry-run", "--json").stdout)["planned"]
    assert len(plan) == 10


# -- requeue's plan speaks in ages ----------------------------------------------------------
def test_the_requeue_plan_says_how_long_ago_the_lease_expired_and_the_owner_was_seen(fresh):
    plan = json.loads(fresh.run("requeue", "--expired", "--dry-run", "--json").stdout)["planned"]
    row = next(r for r in plan if r["job_id"] == "abandoned-0")
    assert re.search(r"lease expired 1m4\ds ago", row["why"]), row  # 100 s, and the test's own seconds
    assert f"owner {ops_app.DEAD} last seen 1h00m ago" in row["why"]


def test_a_refused_requeue_says_when_the_owner_was_last_seen(fresh):
    result = fresh.run("requeue", "--job", "alive-expired")
    assert result.exit_code == 1
    assert re.search(rf"its lease expired \d+\.\ds ago and owner {ops_app.ALIVE} was last seen \d+\.\ds ago",
                     result.output), result.output


# -- dlq discard -------------------------------------------------------------------------
def test_dlq_discard_deletes_dead_letters_and_audits_each(fresh):
    result = fresh.run("dlq", "discard", "--yes", "--job", "failed-0")
    assert result.exit_code == 0, result.output
    assert "discarded 1," in result.stdout
    assert fresh.store.get("failed-0") is None
    event = fresh.store.reports.list_events(job_id="failed-0", event="dlq_discarded")
    assert len(event) == 1 and event[0]["reason"] == "ValueError: boom"
    assert event[0]["worker"].startswith("cli:")
    assert json.loads(event[0]["detail"])["task"] == "ops.fails"


def test_dlq_discard_refuses_a_job_that_is_not_a_dead_letter(fresh):
    result = fresh.run("dlq", "discard", "--yes", "--job", "live-0")
    assert result.exit_code == 1 and "not a dead letter" in result.output
    assert fresh.store.get("live-0").status == "running"


def test_a_dead_letter_redriven_meanwhile_is_skipped_by_discard(fresh):
    job = fresh.store.get("failed-1")
    fresh.store.recovery.redrive(job, "someone")
    from celery_lease.ops import recovery

    outcome = next(recovery.discard(fresh.store, [job], who="test"))
    assert outcome.action == "skipped" and fresh.store.get("failed-1").status == "pending"


@pytest.mark.parametrize("payload", ["{not json", '{"v": 2, "body": "!!", "b64": true}'])
def test_a_job_whose_stored_message_cannot_be_sent_again_is_left_where_it_was(fresh, payload):
    # Moved first, a dead letter would leave the list and wait as pending for a message nobody can send.
    for job_id in ("failed-0", "abandoned-0"):
        ops_app._set(fresh.store, job_id, payload=payload)
    before = {job_id: fresh.store.get(job_id) for job_id in ("failed-0", "abandoned-0")}
    for args in (("dlq", "redrive", "--job", "failed-0"), ("requeue", "--job", "abandoned-0")):
        result = fresh.run(*args, "--yes")
        assert result.exit_code == 1 and "nothing changed: job" in result.output, result.output
        assert "unsendable 1" in result.output and "cannot be read back" in result.output
    assert {job_id: fresh.store.get(job_id) for job_id in before} == before
    assert "dlq discard --job failed-0" in fresh.run("dlq", "redrive", "--job", "failed-0", "--yes").output


# -- effects forget -----------------------------------------------------------------------
def test_effects_forget_deletes_the_key_and_audits_it_under_its_job(fresh):
    live = fresh.store.get("live-1")
    fresh.store.effects.record_effect("mail:7", "live-1", live.lock_token)
    result = fresh.run("effects", "forget", "mail:7", "--yes", "--force")
    assert result.exit_code == 0, result.output
    assert "effect key 'mail:7' of job live-1 forgotten" in result.stdout
    assert fresh.store.reports.effect_record("mail:7") is None
    event = fresh.store.reports.list_events(job_id="live-1", event="effect_forgotten")
    assert len(event) == 1 and event[0]["reason"].startswith("forgotten by cli:")


def test_effects_forget_refuses_a_key_whose_job_holds_a_live_lease_unless_forced(fresh):
    fresh.store.effects.record_effect("mail:7", "live-1", fresh.store.get("live-1").lock_token)
    fresh.store.effects.record_effect("mail:8", "abandoned-1", fresh.store.get("abandoned-1").lock_token)
    result = fresh.run("effects", "forget", "mail:7", "--yes")
    assert result.exit_code == 1 and "holds a live lease" in result.output and "--force" in result.output
    assert fresh.store.reports.effect_record("mail:7")["job_id"] == "live-1"
    assert fresh.run("effects", "forget", "mail:8", "--yes").exit_code == 0  # its owner is gone
    assert fresh.store.reports.effect_record("mail:8") is None


def test_effects_forget_deletes_only_the_record_its_plan_showed(fresh, terminal, monkeypatch):
    fresh.store.effects.record_effect("mail:7", "abandoned-1", fresh.store.get("abandoned-1").lock_token)

    def meanwhile(*args, **kwargs) -> bool:  # while the operator reads the plan, another job takes the key
        assert fresh.store.recovery.forget_effect("mail:7", "someone else")
        assert fresh.store.effects.record_effect("mail:7", "abandoned-2",
                                                 fresh.store.get("abandoned-2").lock_token)
        return True

    monkeypatch.setattr("click.confirm", meanwhile)
    result = fresh.run("effects", "forget", "mail:7")
    assert result.exit_code == 1 and "recorded again by job abandoned-2" in result.output
    assert fresh.store.reports.effect_record("mail:7")["job_id"] == "abandoned-2"
    assert fresh.store.reports.list_events(job_id="abandoned-2", event="effect_forgotten") == []


def test_a_forced_requeue_of_expired_leases_skips_one_its_owner_renewed_after_the_plan(fresh, terminal,
                                                                                       monkeypatch):
    shown = fresh.store.get("alive-expired")

    def meanwhile(*args, **kwargs) -> bool:  # while the operator reads the plan, the owner's heartbeat lands
        renewed = fresh.store.jobs.renew({shown.lock_token: "alive-expired"}, shown.locked_by)
        assert renewed == {"alive-expired"}
        return True

    monkeypatch.setattr("click.confirm", meanwhile)
    result = fresh.run("requeue", "--expired", "--force", "--batch", "100")
    assert "alive-expired" in result.output and "changed since it was read" in result.output
    job = fresh.store.get("alive-expired")
    assert (job.status, job.lock_token) == ("running", shown.lock_token)
    assert fresh.store.reports.list_events(job_id="alive-expired", event="manual_requeue") == []


def test_effects_forget_of_an_unknown_key_is_a_clear_error(fresh):
    result = fresh.run("effects", "forget", "nope", "--yes")
    assert result.exit_code == 1 and "no effect key 'nope'" in result.output


# -- job id prefixes ---------------------------------------------------------------------
def test_a_unique_prefix_names_a_job(fresh):
    assert fresh.json("inspect", "alive-exp")["job"]["id"] == "alive-expired"
    result = fresh.run("dlq", "redrive", "--yes", "--job", "revok")
    assert result.exit_code == 0, result.output
    assert fresh.store.get("revoked-0").status == "pending"
    assert [e["event"] for e in fresh.json("events", "--job", "revok")][-1] == "dlq_redriven"


def test_an_ambiguous_prefix_is_an_error_listing_the_matches(fresh):
    result = fresh.run("requeue", "--job", "abandoned-")
    assert result.exit_code == 1
    assert "matches several jobs (abandoned-0, abandoned-1, abandoned-2)" in result.output
    assert set(statuses(fresh, fresh.ids["abandoned"]).values()) == {"running"}


def test_an_unknown_id_is_a_clear_error_also_when_it_looks_like_a_prefix(fresh):
    result = fresh.run("inspect", "zzz")
    assert result.exit_code == 1 and "no job 'zzz'" in result.output
    assert fresh.run("inspect", "a%").exit_code == 1  # LIKE's wildcards are not wildcards here


def test_the_id_of_a_job_deleted_since_is_no_prefix_of_another_jobs(fresh):
    # A script's line run twice: the second discard must not take order-77 for order-7.
    for job_id in ("order-7", "order-77"):
        fresh.store.publishes.record(job_id, "ops.fails", "celery", None, 3)
        fresh.store.jobs.cancel(job_id, "revoked")
    assert fresh.run("dlq", "discard", "--job", "order-7", "--yes").exit_code == 0
    again = fresh.run("dlq", "discard", "--job", "order-7", "--yes")
    assert again.exit_code == 1 and "no job 'order-7'" in again.output
    assert fresh.store.get("order-77").status == "failed"
    assert fresh.run("requeue", "--job", "order-7", "--force", "--yes").exit_code == 1
    assert {e["job_id"] for e in fresh.json("events", "--job", "order-7")} == {"order-7"}


# -- output shape -------------------------------------------------------------------------
def test_table_cells_stay_on_one_line(fresh):
    fresh.store.publishes.record("multi", "ops.fails", "celery", None, 3)
    ops_app._set(fresh.store, "multi", status="failed", last_error="Traceback:\n  line 1\nValueError: x",
                 failed_at=fresh.store.now())
    out = fresh.run("dlq", "list").output
    row = next(line for line in out.splitlines() if line.startswith("multi "))
    assert "Traceback: | line 1 | ValueError: x" in row
    assert len(out.splitlines()) == 2 + 4  # header, rule, four dead letters: one line each


def test_json_nests_the_checkpoint_and_event_details(fresh):
    live = fresh.store.get("live-0")
    fresh.store.jobs.checkpoint("live-0", live.lock_token, {"step": 2, "done": ["a"]})
    data = fresh.json("inspect", "live-0")
    assert data["job"]["checkpoint"] == {"step": 2, "done": ["a"]}
    checkpoint_event = next(e for e in data["events"] if e["event"] == "checkpoint")
    assert checkpoint_event["detail"] is None or isinstance(checkpoint_event["detail"], dict)
