"""A stand-in for the card processor: it charges every capture it is sent.

Each capture is a row in ``gateway.sqlite3`` in the run directory, so the demo can count
charges per payment. Like many real processors (and every bank transfer), it does not
deduplicate: the shop must not call ``capture`` twice for one payment.
"""

from __future__ import annotations

import time

from . import localdb
from .settings import RUN_DIR

__all__ = ["authorize", "capture", "send_receipt", "captures"]

PATH = RUN_DIR / "gateway.sqlite3"
SCHEMA = """
CREATE TABLE IF NOT EXISTS captures (
    id INTEGER PRIMARY KEY, payment_id TEXT NOT NULL, amount_cents INTEGER NOT NULL,
    idempotency_key TEXT, at REAL NOT NULL
);
"""
AUTHORIZE_SECONDS = 0.5
RECEIPT_SECONDS = 1.0


def authorize(payment_id: str, amount_cents: int) -> None:
    """Check the card (safe to repeat)."""
    time.sleep(AUTHORIZE_SECONDS)


def capture(payment_id: str, amount_cents: int, idempotency_key: str | None = None) -> None:
    """Move the money: one row per call."""
    with localdb.connect(PATH, SCHEMA) as conn:
        conn.execute("INSERT INTO captures (payment_id, amount_cents, idempotency_key, at)"
                     " VALUES (?, ?, ?, ?)", (payment_id, amount_cents, idempotency_key, time.time()))


def send_receipt(payment_id: str) -> None:
    """E-mail the receipt (safe to repeat)."""
    time.sleep(RECEIPT_SECONDS)


def captures() -> dict[str, int]:
    """Charges per payment id."""
    with localdb.connect(PATH, SCHEMA) as conn:
        rows = conn.execute("SELECT payment_id, COUNT(*) AS n FROM captures GROUP BY payment_id").fetchall()
    return {r["payment_id"]: r["n"] for r in rows}
