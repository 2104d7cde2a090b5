"""Render docs/costs.md's cost tables from the benchmarks' saved figures (bench/results/*.json).

    python tools/bench_tables.py                         print the tables
    python tools/bench_tables.py --write docs/costs.md  replace each block between its markers
    python tools/bench_tables.py --check docs/costs.md  exit 1 if a block is out of date

Each block sits between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``;
``make bench`` saves the figures and rewrites the blocks, and tests/unit/test_readme.py keeps
docs/costs.md in step with the saved figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STORES = {"postgres": "PostgreSQL", "postgres-async": "PostgreSQL, `lease_publish_async_commit`",
          "sqlite": "SQLite"}


def _ratios(values: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in values)


def _writes(cost: dict[str, float]) -> str:
    return f"{cost['commits']:.2f} | {cost['rows written']:.2f} | {cost['WAL bytes']:,.0f}"


def _floor(row: dict[str, Any], key: str = "floor") -> str:
    """A floor's median ratio and its rounds (bench/_floor.py), or a dash for figures saved without it."""
    if key not in row:
        return "-"
    return f"{row[key]:.2f} ({_ratios(row[key + 's'])})"


def overhead(data: dict[str, Any]) -> str:
    lines = [
        f"`python -m bench.overhead`, {data['date']}, {data['cores']} cores, {data['tasks']:,} tasks per "
        f"run, median of {data['rounds']} rounds:",
        "",
        "| pool | task body | store | plain Celery tasks/s | LeaseTask tasks/s | ratios by round | median "
        "| floor | group floor | main-process floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        lines.append(f"| {row['pool']} | {row['body']} | {STORES[row['store']]} | {row['plain']:.0f} | "
                     f"{row['lease']:.0f} | {_ratios(row['ratios'])} | {row['median']:.2f} | "
                     f"{_floor(row)} | {_floor(row, 'group')} | {_floor(row, 'main')} |")
    costs = data.get("store_writes_per_job") or {}
    if costs:
        lines += ["", "The worker's writes per job on PostgreSQL (LeaseTask's claim, completion and "
                  "heartbeats, then the floors' writes; the server's own statistics):", "",
                  "| worker, body | commits | rows written | WAL bytes |", "|---|---|---|---|"]
        lines += [f"| {label} | {_writes(cost)} |" for label, cost in costs.items()]
    return "\n".join(lines)


def publish(data: dict[str, Any]) -> str:
    lines = [
        f"`python -m bench.publish`, {data['date']}, {data['cores']} cores, {data['calls']:,} calls per "
        f"round, median of {data['rounds']} rounds:",
        "",
        "| store | key | plain Celery calls/s | LeaseTask calls/s | ratios by round | median |",
        "|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        lines.append(f"| {STORES[row['store']]} | {'yes' if row['key'] else 'no'} | {row['plain']:.0f} | "
                     f"{row['lease']:.0f} | {_ratios(row['ratios'])} | {row['median']:.2f} |")
    if data.get("floors"):
        lines += ["", "The floor: plain Celery's `apply_async` after the least a durable record of the job "
                  "costs (one bare INSERT of the message, bench/_floor.py), to the same plain rounds:", "",
                  "| store | floor ratios by round | median |", "|---|---|---|"]
        lines += [f"| {STORES[row['store']]} | {_ratios(row['ratios'])} | {row['median']:.2f} |"
                  for row in data["floors"]]
    if data.get("groups"):
        lines += ["", f"A `group` of {data['group']:,} signatures, `group(...).apply_async()` (its jobs "
                  f"recorded {data['batch']} to a statement):", "",
                  "| store | plain Celery tasks/s | LeaseTask tasks/s | ratios by round | median |",
                  "|---|---|---|---|---|"]
        lines += [f"| {STORES[row['store']]} | {row['plain']:.0f} | {row['lease']:.0f} | "
                  f"{_ratios(row['ratios'])} | {row['median']:.2f} |" for row in data["groups"]]
    costs = data.get("store_writes_per_publish") or {}
    if costs:
        lines += ["", "| PostgreSQL, per publish | commits | rows written | WAL bytes |", "|---|---|---|---|"]
        lines += [f"| {label} | {_writes(cost)} |" for label, cost in costs.items()]
    return "\n".join(lines)


def backlog(data: dict[str, Any]) -> str:
    times, costs = data["seconds_per_job"], data["store_writes_per_job"]
    names = {"empty": "empty",
             "full": f"{data['history']:,} completed + {data['backlog']:,} pending"}
    lines = [
        f"`python -m bench.backlog`, {data['date']}, {data['cores']} cores, PostgreSQL, {data['jobs']:,} "
        f"jobs claimed and completed per run, one connection, the two tables alternately:",
        "",
        "| jobs table | ms per job, by round | statements | commits | rows written | WAL bytes |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in names.items():
        by_round = " ".join(f"{t * 1000:.3f}" for t in times[key])
        lines.append(f"| {label} | {by_round} | {costs[key]['statements']:.2f} | {_writes(costs[key])} |")
    lines += ["", f"Full table / empty table, by round: {_ratios(data['ratios'])}; median "
              f"**{data['median']:.2f}**."]
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "overhead": overhead, "publish": publish, "backlog": backlog,
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def block(name: str, results: Path = RESULTS) -> str:
    """One benchmark's rendered figures with their markers, as in docs/costs.md."""
    data = json.loads((results / f"{name}.json").read_text(encoding="utf-8"))
    start, end = markers(name)
    return f"{start}\n{RENDERERS[name](data)}\n{end}"


def extract(text: str, name: str) -> str | None:
    start, end = markers(name)
    i, j = text.find(start), text.find(end)
    if i == -1 or j == -1 or j < i:
        return None
    return text[i:j + len(end)]


def replace(text: str, results: Path = RESULTS, names: list[str] | None = None) -> str:
    for name in names or list(RENDERERS):
        current = extract(text, name)
        if current is None:
            raise SystemExit(f"the page lacks the {markers(name)[0]} ... {markers(name)[1]} block")
        text = text.replace(current, block(name, results), 1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PAGE", type=Path, help="rewrite the blocks in this file")
    group.add_argument("--check", metavar="PAGE", type=Path, help="fail if a block is out of date")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the saved figures are")
    args = parser.parse_args(argv)
    if args.write:
        text = args.write.read_text(encoding="utf-8")
        args.write.write_text(replace(text, args.results), encoding="utf-8")
        return 0
    if args.check:
        text = args.check.read_text(encoding="utf-8")
        if replace(text, args.results) != text:
            print(f"{args.check}: cost tables out of date: run `make bench-tables`", file=sys.stderr)
            return 1
        return 0
    for name in RENDERERS:
        print(block(name, args.results), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
