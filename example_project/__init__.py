"""An example shop on celery_lease: payments, invoices and a long report, plus a runnable demo.

``celery -A example_project worker`` finds the app in ``example_project.celery``;
``python -m example_project.demo`` runs the crash-recovery scenario (see the README's demo section).
The package does not import the app itself, so the demo can choose its mode first.
"""
