"""Who may see the page and who may act: sign-in, the Host check, CSRF and response headers.

Without credentials set the page answers only requests addressed to an IP address or ``localhost``
(against DNS rebinding); every POST carries the process's CSRF token."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from typing import Any

from flask import Request, Response, g, redirect, request, url_for

__all__ = ["Guard", "COOKIE", "CSRF_FIELD", "CSRF_HEADER", "is_loopback"]

COOKIE = "celery_lease_web"
CSRF_FIELD = "csrf"
CSRF_HEADER = "X-CSRF-Token"
_PUBLIC = ("static", "sign_in")  # endpoints answered without credentials (the Host check still holds)
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def is_loopback(host: str) -> bool:
    """Whether a listening address only answers this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _addressed_by_ip(host: str) -> bool:
    """Whether a Host header (``name[:port]``, ``[v6][:port]``) names an IP address or localhost."""
    name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _same(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class Guard:
    """The checks of one server process: its credentials and its CSRF token (new per process)."""

    def __init__(self, token: str | None, basic_auth: str | None) -> None:
        self.token = token
        self.user, _, self.password = (basic_auth or "").partition(":")
        self.basic = basic_auth is not None
        self.csrf = secrets.token_urlsafe(32)

    @property
    def open(self) -> bool:
        """No credentials configured: the listening address is the only protection."""
        return self.token is None and not self.basic

    def cookie_value(self) -> str:
        """The sign-in cookie: a digest of the token, so the cookie never holds the token itself."""
        return hmac.new((self.token or "").encode(), b"celery_lease web sign-in", hashlib.sha256).hexdigest()

    def signed_in(self, req: Request) -> str | None:
        """Who the request is (the basic user, or "token"), or None when it carries no valid credentials."""
        if self.basic and req.authorization is not None and req.authorization.type == "basic" and _same(
                req.authorization.username, self.user) and _same(req.authorization.password, self.password):
            return self.user
        if self.token is not None:
            header = req.headers.get("Authorization", "")
            if header.lower().startswith("bearer ") and _same(header[7:].strip(), self.token):
                return "token"
            if _same(req.cookies.get(COOKIE), self.cookie_value()):
                return "token"
        return None

    def check(self) -> Any:
        """The before-request hook: None to go on, or the refusal to send."""
        if self.open and not _addressed_by_ip(request.host):
            return Response(
                "celery_lease web answers requests addressed to an IP address or localhost only, since "
                "neither lease_web_token nor lease_web_basic_auth is set. Set one of them to serve it under "
                "a host name.\n", 403, mimetype="text/plain")
        g.user = "anonymous" if self.open else self.signed_in(request)
        if request.method == "POST" and not _same(
                request.form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER), self.csrf):
            return Response("missing or stale CSRF token: reload the page and try again\n", 403,
                            mimetype="text/plain")
        if g.user is not None or request.endpoint in _PUBLIC:
            return None
        if self.basic:
            return Response("sign in with the user and password of lease_web_basic_auth\n", 401,
                            {"WWW-Authenticate": 'Basic realm="celery_lease", charset="UTF-8"'},
                            mimetype="text/plain")
        if request.method == "GET" and request.accept_mimetypes.accept_html:
            return redirect(url_for("sign_in", next=request.full_path))
        return Response("send the token of lease_web_token: Authorization: Bearer TOKEN\n", 401,
                        {"WWW-Authenticate": 'Bearer realm="celery_lease"'}, mimetype="text/plain")

    def secure(self, response: Response) -> Response:
        """The after-request hook: no caching, no framing, scripts and styles from this server only."""
        response.headers.update(HEADERS)
        response.headers["Cache-Control"] = "no-store"
        return response
