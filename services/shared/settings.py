"""Settings common to every service, read from the environment and an
optional YAML file.

Precedence, strongest first: environment variables, then the YAML file named
by `CONFIG_FILE` (flat keys, lower- or upper-case), then the defaults. Each
service declares its own subclass next to its code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import yaml
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from services.shared.logging import LogFormat, LogLevel
from services.shared.nats_auth import connect_options


class ServiceSettings(BaseSettings):
    # Finite numbers only: "1e999" read as infinity made a cooldown never end.
    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, allow_inf_nan=False)

    # One server, or several of a cluster separated by commas.
    nats_url: str = "nats://127.0.0.1:4222"
    # Copies of every stream and bucket the services create (3 on a cluster of 3).
    jetstream_replicas: int = Field(default=1, ge=1, le=5)
    log_level: LogLevel = "info"
    log_format: LogFormat = "auto"
    # How long a connection attempt may take before we retry (NATS may start later).
    nats_connect_timeout_s: float = Field(default=2.0, gt=0)
    # Prometheus /metrics of a service other than the gateway (which serves
    # them on its HTTP port): off when no port is given.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    # Credentials for NATS (see services/shared/nats_auth.py); all optional.
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_token: SecretStr | None = None
    nats_creds: str | None = None  # a .creds file (JWT and NKey seed)
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None

    def nats_options(self) -> dict[str, Any]:
        """nats-py connect options for the credentials above."""
        secret = {"NATS_PASSWORD": self.nats_password, "NATS_TOKEN": self.nats_token}
        return connect_options({
            "NATS_USER": self.nats_user, "NATS_CREDS": self.nats_creds,
            "NATS_TLS_CA": self.nats_tls_ca, "NATS_TLS_CERT": self.nats_tls_cert,
            "NATS_TLS_KEY": self.nats_tls_key,
            **{name: value.get_secret_value() if value else None
               for name, value in secret.items()}})

    @field_validator("nats_url")
    @classmethod
    def _names_a_server(cls, url: str) -> str:
        nats_servers(url)
        return url

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_values = InitSettingsSource(settings_cls, init_kwargs=read_yaml_config())
        return (init_settings, env_settings, yaml_values)


def read_yaml_config(path: str | None = None) -> dict[str, Any]:
    """The flat mapping in the YAML file named by `CONFIG_FILE`, keys lower-cased."""
    path = path or os.environ.get("CONFIG_FILE")
    if not path:
        return {}
    loaded = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of setting names to values")
    return {str(k).lower(): v for k, v in loaded.items()}


def nats_servers(url: str) -> list[str]:
    """`NATS_URL` as the list of servers the client tries in turn."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError("NATS_URL names no server")
    return servers


def url_has_credentials(url: str) -> bool:
    """Whether a server `url` lists names a user, password or token of its
    own, which nats-py sends when it is given no credentials."""
    return any(_names_credentials(_parts(server)) for server in nats_servers(url))


def shown_url(url: str) -> str:
    """`NATS_URL` as it may be logged: a password or token in it (allowed,
    for a NATS of one's own) would go into every log that keeps the line."""
    return ",".join(_without_secret(server) for server in nats_servers(url))


def _parts(server: str) -> SplitResult:
    return urlsplit(server if "://" in server else f"nats://{server}")


def _names_credentials(parts: SplitResult) -> bool:
    return bool(parts.username or parts.password)


def _without_secret(server: str) -> str:
    parts = _parts(server)
    if not _names_credentials(parts):
        return server
    user = f"{parts.username}:***" if parts.password else "***"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))
