"""`celery lease web` in a real browser: Playwright drives Debian's Chromium against the real command.

The store (PostgreSQL, its URL carrying a password) is filled by a real worker run: a job
completes, two payments fail (dead letters), and a report job is running when the worker is
SIGKILLed, so its lease expires with nobody to renew it (no reaper runs) and the worker goes
stale. Two servers run the command under the path prefix a reverse proxy would forward: one
read-only, one with --allow-actions. One browser serves the whole session.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_lease.store import Store
from tests.apps.web_app import make_app
from tests.conftest import prefixed_redis, unique_prefix
from tests.helpers import wait_for, with_password
from tests.workers import Proc, _spawn, celery_processes, worker

pytestmark = [pytest.mark.integration]

APP = "tests.apps.web_app"
REDIS_DB = 12
PREFIX = "/ops/lease"  # where the reverse proxy forwards the page


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium (Debian's package) for this module, skipped without it, failed in CI.

    Not for the session: Playwright's event loop runs as long as it does, and Django refuses
    synchronous database calls from a thread with a running loop (tests/unit/test_django.py).
    """
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "playwright not installed (pip install playwright): the browser tests need it"
    if path is None:
        reason = "chromium not installed (apt-get install chromium): the browser tests need it"
    if reason is not None:
        if os.environ.get("CELERY_LEASE_REQUIRE_SERVICES"):
            pytest.fail(f"{reason} (CELERY_LEASE_REQUIRE_SERVICES is set)", pytrace=False)
        pytest.skip(reason)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@dataclasses.dataclass
class Run:
    """What the worker run left in the store."""

    store: Store
    env: dict[str, str]
    password: str
    completed: str
    dead_letters: list[str]
    expired: str
    worker: str


def lease_expired_and_owner_stale(store: Store, job_id: str, owner: str) -> bool:
    job, now = store.get(job_id), store.now()
    _, seen = store.reports.workers_last_seen([owner])
    return job.lease_expires_at < now - 0.5 and seen[owner] < now - 2.5


@pytest.fixture(scope="module")
def run(redis_url, postgres_url, tmp_path_factory) -> Iterator[Run]:
    url, password = with_password(postgres_url)
    log_dir = tmp_path_factory.mktemp("web")
    with prefixed_redis(redis_url, REDIS_DB) as (broker, _, keyprefix):
        env = {"WEB_BROKER": broker, "WEB_KEYPREFIX": keyprefix, "WEB_QUEUE": f"web-{keyprefix}",
               "WEB_STORE": url, "WEB_PREFIX": unique_prefix()}
        store = Store(url, env["WEB_PREFIX"])
        store.migrate()
        app = make_app(env)
        try:
            with celery_processes(log_dir) as procs:
                victim = worker(APP, env, log_dir, pool="solo", name="victim")
                procs.append(victim)
                completed = app.tasks["shop.add"].delay(2, 3).id
                dead = [app.tasks["shop.capture_payment"].delay(f"pay-{i}").id for i in range(2)]
                expired = app.tasks["shop.build_report"].delay(60.0).id
                wait_for(lambda: store.get(expired) is not None and store.get(expired).status == "running",
                         timeout=30, message=f"report job never started:\n{victim.output()[-2000:]}")
                assert store.get(completed).status == "completed"
                assert [store.get(j).status for j in dead] == ["failed", "failed"]
                owner = store.get(expired).locked_by
                victim.kill()
            wait_for(lambda: lease_expired_and_owner_stale(store, expired, owner), timeout=15,
                     message="lease never expired")
            yield Run(store, env, password, completed, dead, expired, owner)
        finally:
            store.drop_schema()
            store.engine.dispose()


@dataclasses.dataclass
class Server:
    proc: Proc
    base: str  # http://127.0.0.1:PORT/ops/lease


def serve(run: Run, log_dir: Path, *args: str) -> Server:
    """`celery -A tests.apps.web_app lease web --port 0 --url-prefix /ops/lease ARGS`, once it listens."""
    name = "web-actions" if args else "web-read-only"
    proc = _spawn(["-A", APP, "lease", "web", "--port", "0", "--url-prefix", PREFIX, *args], run.env, log_dir,
                  name)
    found = wait_for(lambda: re.search(r"celery_lease web on (http://\S+)/ ", proc.output()), timeout=30,
                     message=f"{name} never listened: {proc.output()[-2000:]}")
    return Server(proc, found.group(1))


@pytest.fixture(scope="module")
def read_only(run, tmp_path_factory) -> Iterator[Server]:
    server = serve(run, tmp_path_factory.mktemp("ro"))
    yield server
    server.proc.kill()


@pytest.fixture(scope="module")
def actions(run, tmp_path_factory) -> Iterator[Server]:
    server = serve(run, tmp_path_factory.mktemp("rw"), "--allow-actions")
    yield server
    server.proc.kill()


@pytest.fixture
def page(browser) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    yield context.new_page()
    context.close()


def test_the_overview_shows_the_killed_workers_expired_job_and_the_stale_worker(run, read_only, page):
    page.goto(read_only.base + "/")

    expired = page.locator("#expired tbody tr", has_text=run.expired)
    assert "EXPIRED" in expired.inner_text() and "stale" in expired.inner_text()
    assert "stale" in page.locator("#workers tbody tr", has_text=run.worker).inner_text()
    # It refreshes itself: the store time moves on while the page stays the same document.
    page.evaluate("window.notReloaded = true")
    first = page.inner_text(".live-clock")
    page.wait_for_function("t => document.querySelector('.live-clock').innerText !== t", arg=first,
                           timeout=10_000)
    assert page.evaluate("window.notReloaded") is True
    assert page.locator("#expired tbody tr", has_text=run.expired).count() == 1


def test_a_jobs_page_lists_its_timeline_in_order(run, read_only, page):
    page.goto(read_only.base + "/")
    page.click(f"#queues a:text-is('{run.env['WEB_QUEUE']}')")
    page.click(f"#jobs a:text-is('{run.completed}')")

    events = [e for e in page.locator("#timeline li .event").all_inner_texts() if e != "last heartbeat"]
    assert events == ["published", "claimed", "completed"]
    assert page.inner_text("#job-status") == "completed"
    assert "hidden" in page.inner_text("#arguments-hidden")  # 2 and 3 may be personal data


def test_a_redrive_without_allow_actions_is_refused(run, read_only, page):
    job_id = run.dead_letters[0]
    page.goto(read_only.base + "/dead-letters")
    assert page.locator("button[value=redrive]").is_disabled()

    # A hand-made request (the button re-enabled) is refused by the server, not only by the page.
    page.check(f"input[name=job][value='{job_id}']")
    page.evaluate("document.querySelector('button[value=redrive]').disabled = false")
    page.click("button[value=redrive]")

    assert page.inner_text("h1") == "Refused" and "--allow-actions" in page.inner_text("#error")
    assert run.store.get(job_id).status == "failed"


def test_with_allow_actions_a_redrive_is_planned_confirmed_and_audited(run, actions, page):
    job_id = run.dead_letters[1]
    page.goto(actions.base + "/dead-letters")
    page.check(f"input[name=job][value='{job_id}']")
    page.click("button[value=redrive]")

    assert job_id in page.inner_text("#plan") and run.store.get(job_id).status == "failed"  # a plan only
    page.click("#confirm")

    assert "redriven" in page.locator("#outcomes tbody tr", has_text=job_id).inner_text()
    assert run.store.get(job_id).status == "pending"
    [audit] = run.store.reports.list_events(job_id=job_id, event="dlq_redriven")
    assert audit["worker"] == "web:anonymous@127.0.0.1"
    page.click(f"#outcomes a:text-is('{job_id}')")
    assert page.inner_text("#job-status") == "pending"
    assert page.locator("#timeline li .event").all_inner_texts()[-1] == "dlq_redriven"


def test_no_page_shows_the_store_password(run, read_only, actions, page):
    paths = ["/", "/jobs", f"/jobs/{run.expired}", f"/jobs/{run.dead_letters[0]}", "/reaper", "/dead-letters"]
    for server in (read_only, actions):
        for path in paths:
            page.goto(server.base + path)
            assert run.password not in page.content(), path
            assert ":***@" in page.inner_text("#store-url"), path


def test_the_pages_work_under_the_path_prefix(run, read_only, page):
    page.goto(read_only.base + "/")
    for name, heading in (("Jobs", "Jobs"), ("Reaper", "Reaper"), ("Dead letters", "Dead letters"),
                          ("Overview", "Overview")):
        page.click(f"header nav a:text-is('{name}')")
        assert page.url.startswith(read_only.base) and page.inner_text("h1").startswith(heading)
    assert page.get_attribute("#live", "data-live") == PREFIX + "/overview/live"
    # The stylesheet came through the prefix too. The click's navigation may show the heading before
    # the stylesheet has loaded: the page's load event (which waits for it) comes first.
    page.wait_for_load_state("load")
    assert page.evaluate("getComputedStyle(document.querySelector('header')).display") == "flex"
    # A proxy that strips the prefix before forwarding gets pages whose links keep it.
    stripped = page.request.get(read_only.base.removesuffix(PREFIX) + "/jobs")
    assert stripped.status == 200 and f'href="{PREFIX}/reaper"' in stripped.text()
    page.goto(read_only.base + "/reaper")
    assert "requeue" in page.locator("#plan tbody tr", has_text=run.expired).inner_text()

