"""One rule for keeping store passwords out of messages, logs, CLI output, pages and metric labels.

Applied to values where they are formatted, never to a finished page: markup between two values
could look like a URL.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "mask_secrets", "mask_value"]

MASK = "***"

# user:PASSWORD@host, also in a malformed URL (one slash, no scheme); the password runs to the
# URL's last "@" (it may itself hold "@" or "/"), and a URL ends at whitespace or a quote.
_USERINFO = re.compile(r"(?P<head>(?:^|(?<=[/\s'\"=(]))[^\s:/@'\"]*:(?!//))(?P<password>[^\s'\"]*)@")
# ?password=VALUE or &sslpassword=VALUE: any query key naming a password, a secret or a token.
_QUERY = re.compile(r"(?P<head>[?&][^=&#\s'\"]*(?:password|secret|token)[^=&#\s'\"]*=)"
                    r"(?P<value>[^&#\s'\"]*)", re.IGNORECASE)
# password=VALUE in the libpq conninfo psycopg builds from a URL, the value bare or single-quoted.
_KEYWORD = re.compile(r"(?P<head>(?:^|(?<=\s))[a-z_]*(?:password|secret|token)\s*=\s*)"
                      r"(?P<value>'(?:[^'\\]|\\.)*'|[^\s'\"]+)", re.IGNORECASE)


# Who ran a manual recovery, as the audit log names them (``cli:USER@HOST``): shaped like a URL's userinfo,
# so shown whole only standing alone (after a space, an opening parenthesis or at the start) with a host and
# no path; ``admin:pw@db`` inside a URL, a quoted value or ``admin:pw@db/name`` is masked.
_OPERATOR = re.compile(r"\(?(?:cli|web|admin):")
_HOST_ONLY = re.compile(r"[^\s'\"/]*(?=[\s)]|$)")


def _operator(m: re.Match[str]) -> bool:
    start, text = m.start(), m.string
    alone = start == 0 or text[start - 1] in " \t\n("
    return alone and bool(_OPERATOR.fullmatch(m.group("head"))) and bool(_HOST_ONLY.match(text, m.end()))


def mask_secrets(text: str) -> str:
    """``text`` with every secret of every URL in it (password, secret or token) replaced by ``***``."""
    text = _USERINFO.sub(lambda m: m.group(0) if _operator(m) else f"{m.group('head')}{MASK}@", text)
    # A value masked already (a config error's repr) is left as written.
    text = _KEYWORD.sub(lambda m: m.group(0) if m.group("value").strip("'") == MASK
                        else f"{m.group('head')}{MASK}", text)
    return _QUERY.sub(lambda m: f"{m.group('head')}{MASK}" if m.group("value") else m.group(0), text)


def mask_value(value: Any) -> Any:
    """A setting's value fit to show: strings masked, anything else as it is."""
    return mask_secrets(value) if isinstance(value, str) else value
