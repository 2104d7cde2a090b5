"""A process that claims a job, takes a resource lock and holds it until it is killed.

``python -m tests.apps.lock_holder STORE_URL PREFIX JOB_ID RESOURCE TTL`` prints ``held <token>``
once the lock is taken; its heartbeat renews the job lease and the lock every 0.2 s.
"""

from __future__ import annotations

import secrets
import sys
import threading

from celery_lease import deadline
from celery_lease.config import load
from celery_lease.store import ClaimTerms, Store
from celery_lease.worker.lease import Lease
from celery_lease.worker.locks import lock
from celery_lease.worker.runtime import Runtime


def main(url: str, prefix: str, job_id: str, resource: str, ttl: float) -> None:
    store = Store(url, prefix=prefix)
    rt = Runtime(store, "lock-holder", default_interval=0.2)
    store.publishes.record(job_id, "t.hold", "q", "{}", 3)
    token = secrets.token_hex(16)
    sent = deadline.monotonic()
    got = store.jobs.claim(job_id, rt.worker, token,
                           ClaimTerms(duration=3.0, grace=0.0, max_attempts=3, max_expirations=3,
                                      takeover=False),
                           task_name="t.hold", queue="q", payload=lambda: None)
    if not got.claimed:
        raise SystemExit(f"could not claim {job_id}: {got.outcome}")
    policy = load({}).policy({"lease_duration": 3.0, "lease_heartbeat_interval": 0.2})
    lease = Lease(rt, job_id, token, 1, policy, f"t.hold:{job_id}", None, sent_at=sent)
    rt.attach(object(), lease)
    with lock(lease, resource, ttl=ttl) as held:
        sys.stdout.write(f"held {held.token}\n")
        sys.stdout.flush()
        threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
