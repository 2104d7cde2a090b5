"""The project's tasks: a LeaseTask that writes one effect key per order."""

from celery_lease import LeaseTask

from .celery_app import app


@app.task(base=LeaseTask, name="django_project.charge", track_started=True)
def charge(order_id):
    with charge.lease.effect(f"charged:{order_id}") as first:
        return {"first": first, "job_id": charge.request.id}
