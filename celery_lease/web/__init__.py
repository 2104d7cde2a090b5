"""`celery -A proj lease web`: the operator's web page over the lease store (``celery-lease[web]``).

Pages follow the playbook: overview (confirm), jobs and a job's timeline (scope), the reaper's
dry run (check), dead letters with redrive and discard (recover: plan first, then confirm,
only with ``--allow-actions``). ``app`` builds the Flask application and its waitress server;
``security`` decides who may see and act; ``reads`` and ``actions`` are the pages.
"""

INSTALL_HINT = "celery lease web needs Flask and waitress: pip install 'celery-lease[web]'"

__all__ = ["INSTALL_HINT"]
