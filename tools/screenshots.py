"""Screenshots of `celery lease web`'s pages (docs/operators.md): ``make screenshots`` writes docs/img/*.png.

The scene is the operations tests' one (tests/apps/ops_app.py): jobs in flight, abandoned leases of
a worker gone an hour ago, completions, dead letters and one recorded reaper run, in a SQLite store
of a temporary directory. The page is served by waitress in this process with --allow-actions, and
Debian's chromium (driven by Playwright) takes the pictures.

    python tools/screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def scene(store_url: str) -> tuple[object, object]:
    """The ops app over a fresh store filled with the operations tests' scene."""
    os.environ.update(OPS_STORE=store_url, OPS_PREFIX="shots_", OPS_BROKER="memory://")
    from celery_lease.store import for_app
    from tests.apps import ops_app

    app = ops_app.app
    store = for_app(app, check=False, operator=True)
    store.migrate()
    ops_app.populate(store)
    store.jobs.checkpoint("live-0", store.get("live-0").lock_token, {"step": 2, "rows_done": 1200})
    store.effects.record_effect("report-mailed:live-0", "live-0", store.get("live-0").lock_token)
    store.runs.record_reaper_run(0.012, {"seen": 3, "reaped": 2, "skipped_owner_alive": 1}, "reaper@ops:7",
                                 10)
    return app, store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.stderr.write("screenshots need chromium: apt-get install chromium\n")
        return 1
    from playwright.sync_api import sync_playwright

    from celery_lease.web.app import create_app, make_server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lease-shots-"))
    app, store = scene(f"sqlite:///{tmp / 'lease.sqlite3'}")
    server = make_server(create_app(app, store, allow_actions=True), "127.0.0.1", 0)
    threading.Thread(target=server.run, daemon=True).start()
    base = f"http://127.0.0.1:{server.effective_port}"
    shots = [("overview", "/", DESKTOP), ("overview-phone", "/", PHONE),
             ("jobs", "/jobs?status=running", DESKTOP), ("job", "/jobs/abandoned-0", DESKTOP),
             ("reaper", "/reaper", DESKTOP), ("dead-letters", "/dead-letters", DESKTOP)]
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            for name, path, viewport in shots:
                page = browser.new_page(viewport=viewport)
                page.goto(base + path)
                page.screenshot(path=str(out / f"{name}.png"), full_page=viewport is DESKTOP)
                page.close()
            page = browser.new_page(viewport=DESKTOP)
            page.goto(base + "/dead-letters")
            page.check("input[name=job][value=failed-0]")
            page.click("button[value=redrive]")
            page.wait_for_selector("#confirm")
            page.screenshot(path=str(out / "plan.png"), full_page=True)
            browser.close()
    finally:
        server.close()
        store.engine.dispose()  # type: ignore[attr-defined]
        shutil.rmtree(tmp, ignore_errors=True)
    sys.stderr.write(f"wrote {len(shots) + 1} screenshots to {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
