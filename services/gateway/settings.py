"""Gateway settings (environment variables or the YAML file; see README)."""

from __future__ import annotations

from pydantic import Field

from services.shared.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    # Loopback unless told otherwise: the API has no authentication.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8080, ge=0, le=65535)
    # The window and budget of the page's gauge for the next prompt. (The gauge
    # of the last prompt uses the window the generator reported with it.)
    num_ctx: int = Field(default=8192, ge=256)
    output_headroom: int | None = Field(default=None, ge=0)
    model: str = "llama3.2"
    # How long an HTTP caller waits for an answer before getting 504.
    reply_timeout_s: float = Field(default=300.0, gt=0)
