"""Prometheus alert rules for celery_lease (alerts.yml), with their ``runbook_url`` annotations pointing
at the playbook copy an app names (``python -m celery_lease.contrib.prometheus URL`` from a shell)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ...config import RUNBOOK_BASE_URL, app_config

__all__ = ["ALERTS", "rules", "alert_rules"]

ALERTS = Path(__file__).with_name("alerts.yml")


def rules(base_url: str = RUNBOOK_BASE_URL) -> str:
    """The alert rules (YAML text) whose runbook_url annotations start with ``base_url``."""
    text = ALERTS.read_text(encoding="utf-8")
    return text.replace(f'runbook_url: "{RUNBOOK_BASE_URL}#', f'runbook_url: "{base_url}#')


def alert_rules(app: Any) -> str:
    """The alert rules for an app: runbook links built from its ``lease_runbook_base_url``."""
    return rules(app_config(app).runbook_base_url)


if __name__ == "__main__":
    sys.stdout.write(rules(sys.argv[1]) if len(sys.argv) > 1 else rules())
