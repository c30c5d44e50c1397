"""The shop's Django settings: one app, one database shared with jobrelay.

``DJANGO_SHOP_DATABASE`` is the same URL as ``JOBRELAY_DATABASE_URL`` (``sqlite:///path`` or
``postgresql://user:password@host:port/name``), so the order and the job are written in one
transaction. On SQLite, ``transaction_mode: IMMEDIATE`` takes the write lock at ``BEGIN``, as
jobrelay's own transactions do: a deferred transaction that must upgrade its lock while a
worker writes fails with ``database is locked`` instead of waiting.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

SECRET_KEY = "example-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["examples.django_shop.shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def database(url: str) -> dict[str, Any]:
    """Django's DATABASES entry for a jobrelay database URL."""
    parts = urlsplit(url)
    if parts.scheme.startswith("sqlite"):
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": unquote(parts.path[1:]),
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
        }
    return {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3 when installed
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


DATABASES = {
    "default": database(os.environ.get("DJANGO_SHOP_DATABASE", "sqlite:///var/jobrelay.db"))
}
