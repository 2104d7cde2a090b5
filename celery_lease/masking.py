"""One rule for keeping store passwords out of messages, logs, CLI output and metric labels.

A store URL may carry a password (``postgresql+psycopg://user:secret@host/db``). Every
text celery_lease shows that could contain a URL goes through :func:`mask_secrets`,
which also handles a URL SQLAlchemy cannot parse, so a typo never leaks the password.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "mask_secrets", "mask_value"]

MASK = "***"

# user:PASSWORD@host in a URL, also a malformed one (one slash, no scheme): the user part
# starts after a slash, a quote, "=", "(" or whitespace; the password runs to the last "@"
# of the URL (it may itself hold "@" or "/"), and a URL ends at whitespace or a quote.
_USERINFO = re.compile(r"(?P<head>(?:^|(?<=[/\s'\"=(]))[^\s:/@'\"]*:(?!//))(?P<password>[^\s'\"]*)@")


def mask_secrets(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _USERINFO.sub(lambda m: f"{m.group('head')}{MASK}@", text)


def mask_value(value: Any) -> Any:
    """A setting's value fit to show: strings masked, anything else as it is."""
    return mask_secrets(value) if isinstance(value, str) else value
