"""celery_lease.web.security: sign-in by token or basic auth, the Host check, CSRF and headers.

Each test serves a small app over a SQLite store through Flask's test client.
"""

from __future__ import annotations

import base64
import re

import pytest

pytest.importorskip("flask", reason="celery lease web needs Flask: pip install 'celery-lease[web]'")

from celery import Celery  # noqa: E402

from celery_lease.store import Store  # noqa: E402
from celery_lease.web.app import create_app  # noqa: E402
from celery_lease.web.security import COOKIE, is_loopback  # noqa: E402

TOKEN = "t0ken-of-the-night-shift"


@pytest.fixture
def serve(tmp_path):
    """Build a test client for an app with the given settings (and --allow-actions or not)."""
    made = []

    def make(allow_actions: bool = False, **settings):
        url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
        app = Celery("web_security", broker="memory://", set_as_current=False)
        app.conf.update(lease_store_url=url, lease_table_prefix="web_", **settings)
        store = Store(url, "web_")
        store.migrate()
        made.append(store)
        return create_app(app, store, allow_actions=allow_actions).test_client()

    yield make
    for store in made:
        store.engine.dispose()


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_without_credentials_only_requests_addressed_to_an_ip_or_localhost_are_answered(serve):
    client = serve()

    assert client.get("/", base_url="http://127.0.0.1:9809").status_code == 200
    assert client.get("/", base_url="http://localhost:9809").status_code == 200
    assert client.get("/", base_url="http://[::1]:9809").status_code == 200
    refused = client.get("/", base_url="http://rebound.example.com:9809")  # DNS rebinding to 127.0.0.1
    assert refused.status_code == 403 and b"lease_web_token" in refused.data


def test_a_token_server_asks_browsers_to_sign_in_and_scripts_for_a_bearer_header(serve):
    client = serve(lease_web_token=TOKEN)

    page = client.get("/jobs?status=running", headers={"Accept": "text/html"})
    assert page.status_code == 302 and "/sign-in?next=/jobs?status%3Drunning" in page.location
    assert client.get("/", headers={"Accept": "application/json"}).status_code == 401
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).status_code in (302, 401)
    assert client.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_a_token_server_answers_any_host_name(serve):
    client = serve(lease_web_token=TOKEN)

    page = client.get("/", base_url="http://lease.example.com", headers={"Authorization": f"Bearer {TOKEN}"})

    assert page.status_code == 200


def test_signing_in_sets_a_cookie_that_is_not_the_token_and_returns_to_the_page(serve):
    client = serve(lease_web_token=TOKEN)
    csrf = csrf_of(client.get("/sign-in").get_data(as_text=True))

    wrong = client.post("/sign-in", data={"csrf": csrf, "token": "guess", "next": "/reaper"})
    assert wrong.status_code == 401 and client.get_cookie(COOKIE) is None
    signed = client.post("/sign-in", data={"csrf": csrf, "token": TOKEN, "next": "/reaper"})

    assert signed.status_code == 302 and signed.location.endswith("/reaper")
    cookie = client.get_cookie(COOKIE)
    assert cookie is not None and TOKEN not in cookie.value and cookie.http_only
    assert client.get("/reaper").status_code == 200


@pytest.mark.parametrize("target", ["//evil.example/x", "/\t/evil.example", "/\n/evil.example",
                                    "/\\evil.example", "\\/evil.example", "https://evil.example"])
def test_sign_in_never_sends_the_browser_to_another_site(serve, target):
    client = serve(lease_web_token=TOKEN)
    csrf = csrf_of(client.get("/sign-in").get_data(as_text=True))

    signed = client.post("/sign-in", data={"csrf": csrf, "token": TOKEN, "next": target})

    assert signed.status_code == 302 and "evil.example" not in signed.location


def test_basic_auth_challenges_and_accepts_the_configured_user(serve):
    client = serve(lease_web_basic_auth="ops:n1ght")

    challenge = client.get("/")
    assert challenge.status_code == 401 and challenge.headers["WWW-Authenticate"].startswith("Basic")
    assert client.get("/", headers=basic("ops", "wrong")).status_code == 401
    assert client.get("/", headers=basic("root", "n1ght")).status_code == 401
    page = client.get("/", headers=basic("ops", "n1ght"))
    assert page.status_code == 200 and b"signed in as ops" in page.data


def test_a_post_without_the_csrf_token_is_refused_before_anything_is_read(serve):
    client = serve(allow_actions=True)

    missing = client.post("/dead-letters/plan", data={"action": "redrive"})
    forged = client.post("/dead-letters/plan", data={"action": "redrive", "csrf": "forged"})

    assert missing.status_code == forged.status_code == 403
    assert b"CSRF" in missing.data


def test_the_csrf_token_is_new_in_each_server_process(serve):
    first = csrf_of(serve().get("/dead-letters").get_data(as_text=True))
    second = csrf_of(serve().get("/dead-letters").get_data(as_text=True))

    assert first != second


def test_pages_forbid_framing_foreign_scripts_and_caching(serve):
    page = serve().get("/")

    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    assert page.headers["X-Frame-Options"] == "DENY"
    assert page.headers["Cache-Control"] == "no-store"


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("10.1.2.3", False), ("::", False), ("lease.example.com", False)])
def test_only_loopback_addresses_count_as_this_machine(address, loopback):
    assert is_loopback(address) is loopback
