"""`celery -A proj lease web`: the operator's web page over the lease store (``celery-lease[web]``).

Pages follow the playbook: overview, jobs, the reaper's dry run, dead letters (acting only with
``--allow-actions``)."""

INSTALL_HINT = "celery lease web needs Flask and waitress: pip install 'celery-lease[web]'"

__all__ = ["INSTALL_HINT"]
