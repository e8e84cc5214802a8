"""Generator settings (environment variables or the YAML file; see README)."""

from __future__ import annotations

import socket
import uuid
from typing import Literal

from pydantic import Field

from services.shared.jetstream import DEFAULT_LOCK_LEASE_S
from services.shared.settings import ServiceSettings


def _instance_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


class GeneratorSettings(ServiceSettings):
    ollama_host: str = "http://127.0.0.1:11434"
    model: str = "llama3.2"
    num_ctx: int = Field(default=8192, ge=256)
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
    compaction_num_ctx: int | None = Field(default=None, ge=256)
    summary_timeout_s: float = Field(default=120.0, gt=0)
    # Seconds a transcript entry is kept; None: for ever. Never drops what
    # the context still needs (anything from its latest snapshot on).
    transcript_max_age: float | None = Field(default=None, gt=0)
    # Sessions answered at once by this process.
    max_concurrent_sessions: int = Field(default=64, ge=1)
    lock_lease_s: float = Field(default=DEFAULT_LOCK_LEASE_S, ge=1)
    lock_wait_s: float = Field(default=30.0, gt=0)
    # A query unacknowledged this long is redelivered (the process died).
    query_ack_wait_s: float = Field(default=30.0, ge=1)
    ollama_timeout_s: float = Field(default=120.0, gt=0)
    tool_timeout_s: float = Field(default=10.0, gt=0)
    max_tool_iterations: int = Field(default=5, ge=1)
    generator_id: str = Field(default_factory=_instance_id)
