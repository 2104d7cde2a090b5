"""The shop's tasks: capture a payment, issue an invoice, build a long report.

Each one is written for at-least-once delivery: its side effect sits in a
``self.lease.effect`` block, so a job that runs again after a crash does not charge,
invoice or publish twice. ``tracking.execution`` only counts runs for the demo's table;
an app of your own leaves it out.
"""

from __future__ import annotations

import time

from . import gateway, shop
from .celery import BaseTask, app
from .tracking import execution

__all__ = ["capture_payment", "issue_invoice", "build_report"]

INVOICE_SECONDS = 1.0     # rendering the PDF
REPORT_STEP_SECONDS = 0.5  # one slice of the report's query
REPORT_STEPS = 6
RENDER_SECONDS = 0.5


@app.task(base=BaseTask, bind=True, lease_max_attempts=5)
def capture_payment(self, payment_id: str, amount_cents: int) -> str:
    """Authorize, capture once per payment, send the receipt."""
    with execution(self, payment_id) as run:
        gateway.authorize(payment_id, amount_cents)
        with self.lease.effect(f"payment-captured:{payment_id}") as first:
            if first:
                # The processor sees the same key on every attempt of this job.
                gateway.capture(payment_id, amount_cents, idempotency_key=self.lease.idempotency_key)
        run.phase("captured" if first else "capture already done")
        gateway.send_receipt(payment_id)
    return payment_id


@app.task(base=BaseTask, bind=True)
def issue_invoice(self, order_id: str, amount_cents: int) -> str:
    """Render the invoice and store it with its effect key in one transaction."""
    with execution(self, order_id) as run:
        time.sleep(INVOICE_SECONDS)
        with shop.engine().begin() as conn:
            with self.lease.effect(f"invoice-issued:{order_id}", connection=conn) as first:
                if first:
                    conn.execute(shop.invoices.insert().values(
                        order_id=order_id, amount_cents=amount_cents, job_id=self.request.id))
        run.phase("issued" if first else "already issued")
    return order_id


@app.task(base=BaseTask, bind=True, lease_max_attempts=5)
def build_report(self, report_id: str, steps: int = REPORT_STEPS) -> int:
    """A long job in slices: checkpoint after each, resume from the last one after a takeover."""
    with execution(self, report_id) as run:
        state = self.lease.checkpoint_state or {"step": 0, "rows": 0}
        if state["step"]:
            run.phase(f"resumed at step {state['step']}/{steps}")
        for step in range(state["step"], steps):
            time.sleep(REPORT_STEP_SECONDS)
            state = {"step": step + 1, "rows": state["rows"] + 100 * (step + 1)}
            self.lease.checkpoint(state)  # fenced: a stale owner's checkpoint is rejected
            run.phase(f"step {step + 1}/{steps}")
        # The renderer holds the GIL, so the heartbeat thread cannot renew while it runs:
        # renew now for longer than the render takes, then make sure the lease is still ours.
        self.lease.extend(10 * RENDER_SECONDS)
        time.sleep(RENDER_SECONDS)
        self.lease.check()
        with shop.engine().begin() as conn:
            with self.lease.effect(f"report-stored:{report_id}", connection=conn) as first:
                if first:
                    conn.execute(shop.reports.insert().values(
                        report_id=report_id, rows=state["rows"], job_id=self.request.id))
        run.phase("stored" if first else "already stored")
    return state["rows"]
