"""The Flask application of `celery lease web` and its waitress server.

Every value a page shows is masked (``mask_secrets``) before Jinja escapes it, as the CLI's output is."""

from __future__ import annotations

import hmac
from typing import Any

from flask import Flask, g, redirect, render_template, request
from jinja2 import Undefined
from markupsafe import Markup
from werkzeug.exceptions import HTTPException

from ..config import app_config
from ..errors import JobNotFound, LeaseError, StoreUnavailable
from ..masking import mask_secrets
from ..ops.recovery import AmbiguousJobId, RecoveryRefused
from ..store import Store
from .console import Console, console
from .security import COOKIE, CSRF_FIELD, Guard

__all__ = ["Console", "create_app", "make_server", "console", "shown"]

THREADS = 4  # a few operators and their pages' refreshes
TITLES = {400: "Not understood", 403: "Refused", 404: "Not found", 409: "Refused",
          503: "Lease store unavailable"}


def _status(exc: LeaseError) -> int:
    if isinstance(exc, JobNotFound):
        return 404
    if isinstance(exc, (RecoveryRefused, AmbiguousJobId)):
        return 409
    if isinstance(exc, StoreUnavailable):
        return 503
    return 500


def create_app(celery_app: Any, store: Store, *, allow_actions: bool = False) -> Flask:
    """The web application over ``store`` (the app's lease store); read-only unless ``allow_actions``."""
    import celery_lease.web.actions as actions
    import celery_lease.web.reads as reads

    from .filters import register as register_filters

    cfg = app_config(celery_app)
    web = Flask(__name__)
    web.extensions["celery_lease"] = Console(
        celery_app, store, Guard(cfg.web_token, cfg.web_basic_auth), allow_actions, cfg.web_show_arguments)
    guard = web.extensions["celery_lease"].guard
    web.before_request(guard.check)
    web.after_request(guard.secure)
    web.jinja_env.finalize = shown
    register_filters(web)

    @web.context_processor
    def _common() -> dict[str, Any]:
        c = console()
        return {"csrf_field": CSRF_FIELD, "csrf_token": c.guard.csrf, "allow_actions": c.allow_actions,
                "store_url": c.store.safe_url, "user": g.get("user")}

    @web.errorhandler(LeaseError)
    def _lease_error(exc: LeaseError) -> tuple[str, int]:
        status = _status(exc)
        return render_template("error.html", title=TITLES.get(status, "Failed"),
                               message=" ".join(str(exc).split())), status

    @web.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> tuple[str, int]:
        status = exc.code or 500
        return render_template("error.html", title=TITLES.get(status, exc.name),
                               message=exc.description or exc.name), status

    @web.route("/sign-in", methods=["GET", "POST"], endpoint="sign_in")
    def sign_in() -> Any:
        # ``next`` is a path inside the application (without the URL prefix): never another site.
        target = request.values.get("next") or "/"
        # A browser drops tabs and newlines and reads a backslash as a slash: "/\t/evil.example" is "//".
        if (not target.startswith("/") or target.startswith("//") or "\\" in target
                or not target.isprintable()):
            target = "/"
        if request.method == "GET":
            return render_template("sign_in.html", next=target, wrong=False)
        if guard.token is None or not hmac.compare_digest(request.form.get("token", "").encode(),
                                                          guard.token.encode()):
            return render_template("sign_in.html", next=target, wrong=True), 401
        response = redirect(request.script_root + target)
        response.set_cookie(COOKIE, guard.cookie_value(), httponly=True, samesite="Strict",
                            secure=request.is_secure, path=request.script_root or "/")
        return response

    reads.register(web)
    actions.register(web)
    return web


def shown(value: Any) -> Any:
    """A template value as a page shows it (Jinja's ``finalize``): secrets masked, Markup as it is."""
    if value is None or isinstance(value, (Markup, Undefined, bool, int, float)):
        return value
    return mask_secrets(value if isinstance(value, str) else str(value))


def make_server(web: Flask, host: str, port: int, url_prefix: str = "") -> Any:
    """A waitress server for ``web``, not started; ImportError with the install hint without waitress."""
    try:
        from waitress import create_server
    except ImportError as exc:
        raise ImportError("celery lease web needs waitress: pip install 'celery-lease[web]'") from exc
    return create_server(web, host=host, port=port, url_prefix=url_prefix.rstrip("/"), threads=THREADS,
                         ident="celery_lease", clear_untrusted_proxy_headers=True)
