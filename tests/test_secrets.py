"""safe_url masks every secret a PostgreSQL connection URL can carry: the password of the
user part and every libpq connection parameter that holds a secret (``password``,
``sslpassword``, ``oauth_client_secret``), however it is spelled and however often it occurs.
"""

from __future__ import annotations

import pytest

from outbox_bridge.config import SECRET_QUERY_PARAMETERS, safe_url, sqlalchemy_url

SECRET = "s3cr3t-Ünïcode/+&%"
QUOTED = "s3cr3t-%C3%9Cn%C3%AFcode%2F%2B%26%25"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app:{QUOTED}@db.example:5432/outbox",
        f"postgresql://app@db.example/outbox?password={QUOTED}",
        f"postgresql://app@db.example/outbox?sslmode=verify-full&sslpassword={QUOTED}",
        f"postgresql://app@db.example/outbox?oauth_client_secret={QUOTED}",
        f"postgresql://app@db.example/outbox?PASSWORD={QUOTED}",
        f"postgresql://app@db.example/outbox?SslPassword={QUOTED}",
        f"postgresql://app@db.example/outbox?password={QUOTED}&password={QUOTED}",
        f"postgresql://app:{QUOTED}@db.example/outbox?password={QUOTED}&sslpassword={QUOTED}",
    ],
    ids=[
        "user-part",
        "password",
        "sslpassword",
        "oauth_client_secret",
        "upper-case",
        "mixed-case",
        "repeated",
        "all-at-once",
    ],
)
def test_safe_url_masks_every_secret(url: str) -> None:
    shown = safe_url(sqlalchemy_url(url))
    for fragment in (SECRET, QUOTED, "s3cr3t"):
        assert fragment not in shown, shown
    assert "***" in shown
    # What is not secret stays readable.
    assert "db.example" in shown and "outbox" in shown and "app" in shown


def test_safe_url_keeps_the_other_parameters() -> None:
    url = sqlalchemy_url(
        "postgresql://app:pw@db/outbox?sslmode=verify-full&sslrootcert=/ca.pem"
        "&application_name=worker&sslpassword=keypass"
    )
    shown = safe_url(url)
    assert "sslmode=verify-full" in shown
    assert "sslrootcert=" in shown and "ca.pem" in shown
    assert "application_name=worker" in shown
    assert "sslpassword=***" in shown
    assert "keypass" not in shown and ":pw@" not in shown


def test_safe_url_of_a_url_without_secrets_is_the_url() -> None:
    url = sqlalchemy_url("postgresql://app@db:5432/outbox?sslmode=require")
    assert safe_url(url) == "postgresql+psycopg://app@db:5432/outbox?sslmode=require"


def test_the_secret_parameters_are_libpq_s() -> None:
    # libpq's connection parameters that carry a secret (PostgreSQL 18 added OAuth's client
    # secret); the paths of key files (sslkey, passfile) name a secret but are not one.
    assert {"password", "sslpassword", "oauth_client_secret"} <= SECRET_QUERY_PARAMETERS
