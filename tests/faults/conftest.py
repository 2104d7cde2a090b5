"""Print the fault matrix's counts and failing pairs at the end of the run, captured or not."""

from __future__ import annotations

from typing import Any

from tests.faults import matrix


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if matrix.REPORT:
        terminalreporter.section("fault matrix")
        for line in matrix.REPORT:
            terminalreporter.write_line(line)
