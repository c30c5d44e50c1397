"""The one settings object: read once from ``JOBRELAY_*`` and CLI options, frozen, passed down.

Every value has an environment variable and a CLI option of the same name. A bad value is a
``ConfigError`` that names the variable, so the CLI can print one line and exit non-zero
before anything is created.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from jobrelay.errors import ConfigError

ENV_PREFIX = "JOBRELAY_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    database_url: str = "sqlite:///./var/jobrelay.db"
    broker_url: str = "local"
    results_url: str = "file://./var/exports"
    max_attempts: int = Field(default=3, ge=1, le=100)
    retry_delays: Annotated[tuple[int, ...], NoDecode] = (5, 30)
    # A claimed job's lease; the heartbeat renews it every third of this.
    lease_seconds: float = Field(default=30.0, gt=0)
    prefetch: int = Field(default=8, ge=1, le=1000)
    # Crash-loop backstop on the work queue (RabbitMQ x-delivery-limit; local transport too).
    delivery_limit: int = Field(default=5, ge=1)
    confirm_timeout: float = Field(default=10.0, gt=0)
    relay_batch: int = Field(default=200, ge=1, le=10_000)
    relay_poll_seconds: float = Field(default=1.0, gt=0)
    # How long a relay owns the outbox rows it claimed before another relay may take them.
    relay_claim_seconds: float = Field(default=30.0, gt=0)
    # Local transport: how long a delivery stays invisible to other consumers without a renewal.
    visibility_seconds: float = Field(default=30.0, gt=0)
    faults: str = ""
    log_level: str = "INFO"

    @field_validator("retry_delays", mode="before")
    @classmethod
    def _parse_delays(cls, value: Any) -> Any:
        if isinstance(value, str):
            parts = [p.strip() for p in value.split(",") if p.strip()]
            try:
                value = tuple(int(p) for p in parts)
            except ValueError:
                raise ValueError(f"expected comma-separated whole seconds, got {value!r}") from None
        if not value:
            raise ValueError("at least one delay is required")
        if any(d <= 0 for d in value):
            raise ValueError("delays must be positive whole seconds")
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        levels = ("DEBUG", "INFO", "WARNING", "ERROR")
        if value.upper() not in levels:
            raise ValueError(f"expected one of {', '.join(levels)}, got {value!r}")
        return value.upper()

    @field_validator("faults")
    @classmethod
    def _check_faults(cls, value: str) -> str:
        from jobrelay.faults import parse

        try:
            parse(value)
        except ConfigError as exc:
            raise ValueError(exc.problem) from None
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if scheme not in {"sqlite", "sqlite+aiosqlite", "postgresql", "postgresql+asyncpg"}:
            raise ValueError(f"expected sqlite:///PATH or postgresql://…, got {value!r}")
        return value

    @field_validator("broker_url")
    @classmethod
    def _check_broker_url(cls, value: str) -> str:
        if value == "local":
            return value
        parts = urlsplit(value)
        if parts.scheme not in {"amqp", "amqps"} or not parts.hostname:
            raise ValueError(f"expected 'local' or amqp://user:pass@host:5672/vhost, got {value!r}")
        return value

    @field_validator("results_url")
    @classmethod
    def _check_results_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme != "file" or not (parts.netloc + parts.path):
            raise ValueError(f"expected file://PATH, got {value!r}")
        return value

    @property
    def is_postgres(self) -> bool:
        return urlsplit(self.database_url).scheme.startswith("postgresql")

    @property
    def uses_local_broker(self) -> bool:
        return self.broker_url == "local"

    def redacted(self) -> dict[str, Any]:
        """Settings safe to log: passwords in URLs replaced."""
        out = self.model_dump()
        for key in ("database_url", "broker_url", "results_url"):
            out[key] = redact_url(out[key])
        return out


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from the environment plus non-None overrides (CLI options)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "settings"
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(ENV_PREFIX + field.upper(), message) from None
