"""Where a benchmark run leaves its figures: bench/results/NAME.json, read by tools/bench_tables.py.

docs/costs.md's cost tables are rendered from these files (`make bench` runs every benchmark
with ``--save`` and then rewrites the tables), so that page shows what a run printed.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def save(name: str, data: dict[str, Any]) -> Path:
    """Write one benchmark's figures with the date and the machine's core count."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {"date": datetime.date.today().isoformat(), "cores": os.cpu_count(), **data}
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"figures saved to {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return path
