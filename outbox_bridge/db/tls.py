"""PostgreSQL's TLS: a server that fails the verification the URL asks for (``sslmode=verify-ca``
or ``verify-full``, with ``sslrootcert``) is a configuration error, said in one line with what to
check and without the password, never retried as an outage."""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.engine import URL, ExceptionContext
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.errors import ConfigurationError

# What libpq says when the server's certificate, or TLS itself, fails what sslmode asks.
_TLS_FAILURES = (
    "certificate verify failed",
    "does not match host name",
    "server certificate for",
    "root certificate file",
    "server does not support SSL",
    "SSL error",
    "certificate is not yet valid",
    "certificate has expired",
)


def tls_refusal(exc: BaseException, url: URL) -> ConfigurationError | None:
    """The :class:`ConfigurationError` for a connection to ``url`` that TLS refused, or None
    when ``exc`` is something else (an outage is retried, not reported as this)."""
    cause = getattr(exc, "orig", None) or exc
    text = str(cause)
    found = next((failure for failure in _TLS_FAILURES if failure in text), None)
    if found is None:
        return None
    # libpq's reason is its message's last line ("... failed: SSL error: ...").
    reason = text.strip().splitlines()[-1].split(" failed: ")[-1].strip()
    mode = url.query.get("sslmode", "prefer")
    where = f"{url.host or 'localhost'}:{url.port or 5432}"
    return ConfigurationError(
        f"cannot connect to PostgreSQL at {where} over TLS (sslmode={mode}): {reason}. Check "
        "that sslrootcert names the CA that signed the server's certificate and, with "
        "verify-full, that the URL's host is a name the certificate holds; sslcert and sslkey "
        "if the server asks for a client certificate"
    )


def refuse_tls_failures(engine: AsyncEngine) -> None:
    """Make a TLS refusal on ``engine``'s connections raise :func:`tls_refusal`'s error."""

    @event.listens_for(engine.sync_engine, "handle_error")
    def _refused(context: ExceptionContext) -> BaseException | None:
        if context.connection is not None:
            return None  # a statement failed on an open connection: not TLS's verification
        return tls_refusal(context.original_exception, engine.url)
