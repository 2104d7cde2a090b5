"""README.md's settings table is the one generated from celery_lease.config.SETTINGS; docs/costs.md's
cost tables are the saved benchmark figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    """A script of tools/ as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tool():
    return load("settings_table")


def test_readme_settings_table_matches_the_code():
    tool = load_tool()
    current = tool.extract((ROOT / "README.md").read_text(encoding="utf-8"))

    assert current is not None, "README.md lacks the <!-- settings:start/end --> markers"
    assert current == tool.block(), "README settings table is out of date: run `make settings-table`"


def test_settings_table_has_one_row_per_setting():
    from celery_lease.config import SETTINGS

    tool = load_tool()
    rows = [line for line in tool.table().splitlines() if line.startswith("| `lease_")]
    assert [row.split("`")[1] for row in rows] == [s.name for s in SETTINGS]


def test_write_replaces_only_the_marked_block(tmp_path):
    tool = load_tool()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{tool.START}\nOLD TABLE ROW\n{tool.END}\n\noutro\n", encoding="utf-8")

    assert tool.main(["--write", str(readme)]) == 0

    text = readme.read_text(encoding="utf-8")
    assert text.startswith("intro\n\n") and text.endswith("\n\noutro\n")
    assert "OLD TABLE ROW" not in text
    assert tool.main(["--check", str(readme)]) == 0


def load_bench_tables():
    return load("bench_tables")


def test_cost_page_tables_are_the_saved_benchmark_figures():
    tool = load_bench_tables()
    text = (ROOT / "docs" / "costs.md").read_text(encoding="utf-8")
    for name in tool.RENDERERS:
        current = tool.extract(text, name)
        assert current is not None, f"docs/costs.md lacks the bench:{name} markers"
        assert current == tool.block(name), (
            f"docs/costs.md's {name} figures are stale: run `make bench-tables`")


def test_cost_tables_render_each_saved_row(tmp_path):
    tool = load_bench_tables()
    (tmp_path / "publish.json").write_text(json.dumps({
        "date": "2026-01-01", "cores": 2, "calls": 10, "rounds": 1, "store_writes_per_publish": {},
        "rows": [{"store": "postgres", "key": True, "plain": 100.0, "lease": 61.0, "ratios": [0.61],
                  "median": 0.61}],
    }))
    rendered = tool.block("publish", tmp_path)
    assert "| PostgreSQL | yes | 100 | 61 | 0.61 | 0.61 |" in rendered
    readme = tmp_path / "README.md"
    start, end = tool.markers("publish")
    readme.write_text(f"intro\n{start}\nold\n{end}\noutro\n", encoding="utf-8")
    assert "old" not in tool.replace(readme.read_text(), tmp_path, names=["publish"])


def test_the_upgrading_table_has_one_row_per_schema_revision():
    from celery_lease.store import migrations

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Upgrading", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| 0")]
    assert rows == list(migrations.revisions())


def test_cost_tables_show_the_floor_next_to_leasetask(tmp_path):
    tool = load_bench_tables()
    (tmp_path / "overhead.json").write_text(json.dumps({
        "date": "2026-01-01", "cores": 2, "tasks": 10, "rounds": 2,
        "rows": [{"pool": "threads -c8", "body": "10 ms", "store": "postgres", "plain": 100.0, "lease": 70.0,
                  "ratios": [0.7, 0.72], "median": 0.71, "floors": [0.9, 0.88], "floor": 0.89},
                 {"pool": "prefork -c4", "body": "no-op", "store": "sqlite", "plain": 100.0, "lease": 50.0,
                  "ratios": [0.5], "median": 0.5}],
    }))
    (tmp_path / "publish.json").write_text(json.dumps({
        "date": "2026-01-01", "cores": 2, "calls": 10, "rounds": 1, "rows": [],
        "floors": [{"store": "sqlite", "ratios": [0.55, 0.6], "median": 0.58}],
    }))
    rendered = tool.block("overhead", tmp_path)
    assert "| threads -c8 | 10 ms | PostgreSQL | 100 | 70 | 0.70 0.72 | 0.71 | 0.89 (0.90 0.88) |" in rendered
    # Figures saved before the floor existed still render, without one.
    assert "| prefork -c4 | no-op | SQLite | 100 | 50 | 0.50 | 0.50 | - |" in tool.block("overhead", tmp_path)
    assert "| SQLite | 0.55 0.60 | 0.58 |" in tool.block("publish", tmp_path)


def test_every_reaper_schedule_in_the_readme_passes_lease_checks_reaper_rules(tmp_path):
    import re

    from celery import Celery

    from celery_lease.ops.checks import run_checks
    from celery_lease.store import Store

    blocks = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    schedules = [block for block in blocks if "celery_lease.reap" in block]
    assert len(schedules) >= 2  # the example at the top and "Adding celery_lease to an existing app"
    for block in schedules:
        app = Celery("readme", broker="memory://", set_as_current=False)
        app.conf.update(lease_store_url=f"sqlite:///{tmp_path / 'lease.sqlite3'}", beat_schedule={})
        statement = re.search(r"^app\.conf\.beat_schedule = \{\n.*?^\}\n", block, re.MULTILINE | re.DOTALL)
        exec(statement.group(0), {"app": app})  # noqa: S102 - the README's own statement
        store = Store(app.conf.lease_store_url, "readme_")
        store.migrate()
        found = {f.code: f for f in run_checks(app, store) if f.code.startswith("reaper_")}
        assert found["reaper_scheduled"].level == "ok", block
        assert found["reaper_routing"].level == "ok", (block, found["reaper_routing"].values)
