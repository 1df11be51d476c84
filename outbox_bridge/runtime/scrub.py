"""Credentials taken out of error text before Temporal keeps it: a handler's exception message
may quote a connection URL, a request's headers or a settings dict, and a workflow's history is
read by everyone with access to the namespace, kept for its retention period and exported."""

from __future__ import annotations

import re

MASK = "***"

# Words that make a key secret: `password=`, `"api_key": `, `X-Auth-Token: `, `DB_PASSWD=`, ...
_SECRET_WORDS = (
    r"pass(?:word|wd|phrase)?|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|"
    r"credentials?|auth|authorization|session[_-]?id|cookie|signature|sslpassword"
)
_SECRET_KEY = re.compile(rf"(?:{_SECRET_WORDS})(?![a-z])", re.IGNORECASE)
# A key (maybe quoted, maybe prefixed: `db_password`, `X-Api-Key`), `=` or `:`, then the value:
# quoted, or up to a space or a separator. A key starts where no key character precedes it, so
# that a long word is read once, not from each of its characters.
_PAIR = re.compile(
    r"""(?P<key>(?<![\w.-])["']?[\w.-]+["']?\s*[=:]\s*)"""
    r"""(?P<scheme>(?:Bearer|Basic|Token|Digest)\s+)?"""
    r"""(?P<value>"[^"]*"|'[^']*'|[^\s,;&)}\]]+)""",
    re.IGNORECASE,
)
# `scheme://user:password@host`: the password, whatever the scheme.
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[a-z][a-z0-9+.-]*://[^\s:/@]*:)(?P<value>[^\s@/]+)(?=@)", re.IGNORECASE
)
# A bearer token anywhere (not after a key: `curl -H 'Bearer …'` in a message).
_BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<value>[\w.~+/=-]{8,})", re.IGNORECASE)


def _masked_pair(found: re.Match[str]) -> str:
    key = found.group("key")
    if not _SECRET_KEY.search(key):
        return found.group(0)
    value = found.group("value")
    quote = value[0] if value[:1] in ("'", '"') and len(value) > 1 else ""
    return f"{key}{found.group('scheme') or ''}{quote}{MASK}{quote}"


def scrub_credentials(text: str) -> str:
    """``text`` with the passwords of URLs, the values of keys that look secret (``password``,
    ``token``, ``secret``, ``api_key``, ``Authorization``, ...) and bearer tokens masked by
    ``***``; the rest, which says what went wrong, is kept as it is.

    A best effort on free text: a credential that no key names (a bare password in a sentence)
    is not recognised. Keep secrets out of messages, or keep messages out of Temporal (the
    ``redact_errors`` setting) or encode them with your codec (``payload_codec``)."""
    text = _URL_PASSWORD.sub(lambda m: m.group("head") + MASK, text)
    text = _PAIR.sub(_masked_pair, text)
    return _BEARER.sub(lambda m: m.group("head") + MASK, text)
