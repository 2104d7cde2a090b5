"""Generate the README's settings table from celery_lease.config.SETTINGS.

    python tools/settings_table.py                   print the table
    python tools/settings_table.py --write README.md  replace the block between the markers
    python tools/settings_table.py --check README.md  exit 1 if the block is out of date

The block sits between ``<!-- settings:start -->`` and ``<!-- settings:end -->``;
tests/unit/test_readme.py keeps it in step with the code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(ROOT))

from celery_lease.config import SETTINGS  # noqa: E402

START = "<!-- settings:start -->"
END = "<!-- settings:end -->"


def _default(value: Any) -> str:
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table() -> str:
    """The markdown table: setting | default | per task | what it is for."""
    lines = [
        "| setting | default | per task | what it is for |",
        "|---|---|---|---|",
    ]
    for s in SETTINGS:
        lines.append(
            f"| `{s.name}` | {_cell(_default(s.default))} | {'yes' if s.per_task else 'no'} | "
            f"{_cell(s.doc)} Must be {_cell(s.rule)}. |"
        )
    return "\n".join(lines) + "\n"


def block() -> str:
    """The table with its markers, as it appears in the README."""
    return f"{START}\n{table()}{END}"


def extract(text: str) -> str | None:
    """The marked block of ``text`` (markers included), or None when it has no markers."""
    start, end = text.find(START), text.find(END)
    if start == -1 or end == -1 or end < start:
        return None
    return text[start:end + len(END)]


def replace(text: str) -> str:
    current = extract(text)
    if current is None:
        raise SystemExit(f"no {START} ... {END} block found")
    return text.replace(current, block(), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="README", type=Path, help="rewrite the block in this file")
    group.add_argument("--check", metavar="README", type=Path, help="fail if the block is out of date")
    args = parser.parse_args(argv)
    if args.write:
        text = args.write.read_text(encoding="utf-8")
        new = replace(text)
        if new != text:
            args.write.write_text(new, encoding="utf-8")
            print(f"updated the settings table in {args.write}")
        return 0
    if args.check:
        if extract(args.check.read_text(encoding="utf-8")) != block():
            print(f"{args.check}: settings table is out of date; run `make settings-table`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
