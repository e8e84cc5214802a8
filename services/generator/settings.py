"""Generator settings (environment variables or the YAML file; see README)."""

from __future__ import annotations

import socket
import uuid
from typing import Literal

from pydantic import Field, model_validator

from services.core.tokens import MIN_NUM_CTX, check_headroom
from services.generator.models import TimeLimits
from services.shared.jetstream import DEFAULT_LOCK_LEASE_S
from services.shared.settings import ServiceSettings

# Loading a model from disk, waiting for Ollama's one free slot and reading an
# 8k-token prompt on a CPU can each take a minute or more.
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 300.0
# Once it streams, even a slow CPU gives a token every second or two.
DEFAULT_TOKEN_GAP_TIMEOUT_S = 60.0


def _instance_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


class GeneratorSettings(ServiceSettings):
    ollama_host: str = "http://127.0.0.1:11434"
    model: str = "llama3.2"
    num_ctx: int = Field(default=8192, ge=MIN_NUM_CTX)
    # Tokens kept free for the answer: the prompt budget is num_ctx minus this.
    # None: an eighth of the window, at least 256.
    output_headroom: int | None = Field(default=None, ge=0)
    # The generator compacts on its own only as a last resort before an
    # overflow, and not at all when this is 0 (automatic compaction off).
    compaction_threshold: float = Field(default=0.8, ge=0, le=1)
    compaction_tail_turns: int = Field(default=4, ge=1)
    compaction_mode: Literal["background", "blocking"] = "background"
    # In blocking mode, how long a query waits for a compaction before it is refused.
    blocking_query_wait_s: float = Field(default=0.0, ge=0)
    compaction_model: str | None = None
    # The summariser's window (COMPACTION_MODEL may be another model); None: num_ctx.
    compaction_num_ctx: int | None = Field(default=None, ge=MIN_NUM_CTX)
    # A whole summary call's limit; the two model limits below apply within it.
    summary_timeout_s: float = Field(default=600.0, gt=0)
    # Seconds a transcript entry is kept; None: for ever. Never drops what
    # the context still needs (anything from its latest snapshot on).
    transcript_max_age: float | None = Field(default=None, gt=0)
    # Sessions answered at once by this process.
    max_concurrent_sessions: int = Field(default=64, ge=1)
    lock_lease_s: float = Field(default=DEFAULT_LOCK_LEASE_S, ge=1)
    lock_wait_s: float = Field(default=30.0, gt=0)
    # A query unacknowledged this long is redelivered (the process died): the
    # longest a killed generator's session waits. Beaten every third of it, so
    # a stall of two thirds is needed to redeliver one in hand; at 10 s that is
    # longer than the default lease, whose loss a stall meets first anyway.
    query_ack_wait_s: float = Field(default=10.0, ge=1)
    # How long a query that NATS does not answer for (a reconnect, a stream
    # electing its leader) is tried again before its caller gets 503.
    nats_away_patience_s: float = Field(default=30.0, ge=0)
    # Until the first token: the model may have to load, wait for a free slot
    # and read a long prompt first. Then the longest pause between two tokens.
    ollama_first_token_timeout_s: float | None = Field(default=None, gt=0)
    ollama_token_gap_timeout_s: float | None = Field(default=None, gt=0)
    # The former single limit: when set, both of the above unless they are set.
    ollama_timeout_s: float | None = Field(default=None, gt=0)
    # Thinking models: "auto" leaves them their default (they think), "on" or
    # "off" says so on every answer. Summaries are always asked without it.
    think: Literal["auto", "on", "off"] = "auto"
    tool_timeout_s: float = Field(default=10.0, gt=0)
    max_tool_iterations: int = Field(default=5, ge=1)
    generator_id: str = Field(default_factory=_instance_id)

    def model_time_limits(self) -> TimeLimits:
        fallback = self.ollama_timeout_s
        return TimeLimits(
            self.ollama_first_token_timeout_s or fallback or DEFAULT_FIRST_TOKEN_TIMEOUT_S,
            self.ollama_token_gap_timeout_s or fallback or DEFAULT_TOKEN_GAP_TIMEOUT_S)

    @model_validator(mode="after")
    def _leaves_room_for_a_prompt(self) -> GeneratorSettings:
        check_headroom(self.num_ctx, self.output_headroom)
        return self
