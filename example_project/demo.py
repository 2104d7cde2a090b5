"""``python -m example_project.demo [--mode lease|plain]``: a crash recovered before your eyes.

Starts three real ``celery worker`` processes (and, in lease mode, the reaper's worker
and ``celery beat``), publishes 20 shop jobs, SIGKILLs one worker right after it charged
a card, SIGSTOPs another in the middle of a report until its lease is past, resumes it,
and waits for the end. Then it prints a timeline, second by second, and the final table.

Exit status: 0 when the run kept every guarantee celery_lease makes that it exercised (lease mode)
or simply ran (plain mode, where Celery is expected to lose or repeat work); 1 when a
guarantee was broken in lease mode; 2 when the scenario itself could not be played.

Runs on the embedded default (SQLite files, no server). ``CELERY_BROKER_URL`` and
``EXAMPLE_LEASE_STORE_URL`` move it to Redis and PostgreSQL (see settings.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_BROKEN, EXIT_NOT_PLAYED = 0, 1, 2
RESULT_FILE = "result.json"  # the final table and the checks, for tests and scripts
MODES = {
    "lease": "LeaseTask + heartbeat + reaper",
    "plain": "plain Celery tasks, no celery_lease",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m example_project.demo",
        description="A crash recovered before your eyes: 20 shop jobs, a worker SIGKILLed, another "
                    "frozen past its lease, then a timeline and the final table.")
    parser.add_argument("--mode", choices=sorted(MODES), default="lease",
                        help="lease (default): the shop on celery_lease; plain: the same tasks, plain Celery")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="directory for the SQLite files and worker logs (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory after a successful run")
    return parser.parse_args(argv)


def _configure(mode: str, run_dir: Path) -> None:
    """Environment for this process and the celery processes it starts; read when the app is imported."""
    os.environ["EXAMPLE_MODE"] = mode
    os.environ["EXAMPLE_RUN_DIR"] = str(run_dir)
    store_url = os.environ.get("EXAMPLE_LEASE_STORE_URL", "")
    if store_url and not store_url.startswith("sqlite") and "EXAMPLE_TABLE_PREFIX" not in os.environ:
        # A shared database: tables of this run only, dropped at the end.
        os.environ["EXAMPLE_TABLE_PREFIX"] = f"demo{uuid.uuid4().hex[:6]}_"


def _prepare(app: Any, mode: str) -> None:
    """Create the shop's and the store's tables; empty the demo's queues on a server broker."""
    from . import settings, shop

    shop.migrate()
    if mode == "lease":
        from celery_lease.store import for_app

        for_app(app, check=False).migrate()
    with app.connection_for_write() as conn:
        for queue in (settings.task_default_queue, settings.MAINTENANCE_QUEUE):
            conn.default_channel.queue_declare(queue, durable=True, auto_delete=False)
            if not settings.broker_url.startswith("sqlite:"):
                conn.default_channel.queue_purge(queue)


def _drop_tables(app: Any, mode: str) -> None:
    from . import shop

    shop.metadata.drop_all(shop.engine())
    if mode == "lease":
        from celery_lease.store import for_app

        store = for_app(app, check=False)
        store.t.metadata.drop_all(store.engine)


def _header(mode: str, run_dir: Path) -> list[str]:
    from . import settings

    broker = settings.broker_url
    if broker.startswith("sqlite:"):
        broker += " (kombu SQLAlchemy transport)"
    lines = [
        f"celery_lease demo, mode {mode}: {MODES[mode]}",
        f"  broker       {broker}",
        f"  lease store  {settings.lease_store_url}" + ("" if mode == "lease" else " (not used)"),
        "  Celery       acks_late" + (", reject_on_worker_lost" if mode == "plain" else "")
        + ", prefetch 1; 3 workers, prefork, 1 process each",
    ]
    if mode == "lease":
        lines.append(f"  leases       {settings.lease_duration:g}s, "
                     f"heartbeat {settings.lease_heartbeat_interval:g}s, "
                     f"grace {settings.lease_grace_period:g}s, reaper every {settings.REAPER_INTERVAL:g}s, "
                     f"workers stale after {settings.lease_worker_stale_after:g}s")
    lines.append(f"  run dir      {run_dir} (worker logs, SQLite files)")
    return lines


def _report(record: Any, started: float, run_dir: Path) -> int:
    from . import outcome, timeline

    table = outcome.tabulate(record)
    checks = outcome.check(record, table)
    (run_dir / RESULT_FILE).write_text(json.dumps({
        "mode": record.mode, "seconds": round(time.monotonic() - started, 1),
        "table": dataclasses.asdict(table), "checks": [dataclasses.asdict(c) for c in checks],
    }, indent=2))
    print()
    print("timeline (seconds since the jobs were published)")
    for line in timeline.render(record):
        print(line)
    print()
    print("final table")
    for line in table.markdown():
        print(line)
    print()
    print("guarantees this run exercised:")
    for c in checks:
        mark = "n/a   " if c.ok is None else ("ok    " if c.ok else "BROKEN")
        print(f"  {mark} {c.name}: {c.detail}")
    broken = [c for c in checks if c.ok is False]
    print()
    print(f"demo ran {time.monotonic() - started:.1f}s")
    if record.mode == "plain":
        if broken:
            print(f"plain Celery broke {len(broken)} of them, as expected: that is what celery_lease is for. "
                  "Exit status 0.")
        return EXIT_OK
    if broken:
        print(f"{len(broken)} guarantee(s) broken: exit status {EXIT_BROKEN}")
        return EXIT_BROKEN
    return EXIT_OK


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    # Python's default SIGTERM ends the process without unwinding: the workers' process
    # groups would outlive the demo. SystemExit runs the cleanup below.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"celery-lease-demo-{args.mode}-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    _configure(args.mode, run_dir)

    from . import settings
    from .celery import app
    from .processes import Processes
    from .scenario import Scenario, ScenarioError

    for line in _header(args.mode, run_dir):
        print(line)
    status = EXIT_NOT_PLAYED
    shared_db = not settings.lease_store_url.startswith("sqlite")
    try:
        _prepare(app, args.mode)
        with Processes("example_project", run_dir) as procs:
            scenario = Scenario(args.mode, app, procs, say=lambda text: print(text, flush=True))
            scenario.start()
            scenario.publish()
            scenario.kill_mid_payment()
            scenario.stop_past_lease()
            scenario.wait_for_end()
        status = _report(scenario.collect(), started, run_dir)
    except ScenarioError as exc:
        print(f"\nthe scenario could not be played: {exc}")
        _print_log_tails(run_dir)
    finally:
        if shared_db:
            _drop_tables(app, args.mode)
    if status == EXIT_OK and not args.keep and args.run_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"run directory kept: {run_dir}")
    return status


def _print_log_tails(run_dir: Path, lines: int = 8) -> None:
    """The last lines of each process's log: what a step waited for may say why it never came."""
    for log in sorted(run_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"\n  last lines of {log.name}:")
        for line in tail:
            print(f"    {line[:300]}")


if __name__ == "__main__":
    raise SystemExit(main())
