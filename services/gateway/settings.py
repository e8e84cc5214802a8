"""Gateway settings (environment variables or the YAML file; see README)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from services.core.tokens import MIN_NUM_CTX, check_headroom
from services.shared.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    # Loopback unless told otherwise: without a token the API is open to
    # whoever reaches the port.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8080, ge=0, le=65535)
    # The window and budget of the page's gauge for the next prompt. (The gauge
    # of the last prompt uses the window the generator reported with it.)
    num_ctx: int = Field(default=8192, ge=MIN_NUM_CTX)
    output_headroom: int | None = Field(default=None, ge=0)
    model: str = "llama3.2"
    # Where automatic compaction begins, as a share of the budget: the gauge
    # marks it and warns from it. Set, and changed live, as the decider's is.
    compaction_threshold: float = Field(default=0.8, ge=0, le=1)
    # How long an HTTP caller waits for an answer before getting 504.
    reply_timeout_s: float = Field(default=300.0, gt=0)
    # How long a query NATS does not take (a stream electing its leader) is
    # offered again, under the same id, before the caller gets 503.
    nats_away_patience_s: float = Field(default=30.0, ge=0)
    # Host names the gateway answers to, comma-separated ("*": any). Empty:
    # localhost, 127.0.0.1, [::1] and the bound address if it is not a wildcard.
    gateway_allowed_hosts: str = ""
    # Origins besides the gateway's own whose pages may write or listen.
    gateway_allowed_origins: str = ""
    # Required on every request but /healthz when set; "auto" makes one up.
    gateway_token: str | None = None
    # Over the largest valid message (1,000,000 characters of up to 4 bytes
    # in UTF-8) and at NATS's max_payload, which no larger query could cross.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    # When the gateway stops, how long a caller still waiting may get its
    # answer before it is told 503 `gateway_stopping` (kept below the
    # services' bound on stopping, SHUTDOWN_TIMEOUT_S).
    stop_grace_s: float = Field(default=5.0, ge=0, le=6)
    # Open /api/events streams per client address (a tab holds one).
    max_event_streams_per_client: int = Field(default=16, ge=1)

    @field_validator("gateway_token")
    @classmethod
    def _printable_or_none(cls, token: str | None) -> str | None:
        # It travels in a header and a cookie: printable ASCII, no spaces.
        if token and not all("!" <= char <= "~" for char in token):
            raise ValueError("GATEWAY_TOKEN may hold only printable ASCII characters, no spaces")
        return token or None

    @model_validator(mode="after")
    def _leaves_room_for_a_prompt(self) -> GatewaySettings:
        check_headroom(self.num_ctx, self.output_headroom)
        return self
