"""A session's durable settings and calibration (the `sessions` KV bucket)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from schemas.envelope import utc_now

MAX_SYSTEM_PROMPT_CHARS = 200_000


class SessionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    # Pinned outside the history: sent byte-identical on every call.
    system: str = Field(default="", max_length=MAX_SYSTEM_PROMPT_CHARS)
    # None: the generator's configured model.
    model: str | None = Field(default=None, max_length=200)
    auto_compact: bool = True
    created_at: datetime = Field(default_factory=utc_now)
    # The provider's own tokens-per-character from its last usable report.
    tokens_per_char: float | None = Field(default=None, gt=0)
    compactions: int = Field(default=0, ge=0)
    # The window the session's model was trained for, as the generator last
    # read it from the model server; a smaller NUM_CTX wins. None: not known.
    context_length: int | None = Field(default=None, gt=0)

    def window(self, num_ctx: int) -> int:
        """The window to use with this session's model: `num_ctx`, or the
        model's own if it is smaller."""
        return num_ctx if self.context_length is None else min(num_ctx, self.context_length)

    def model_or(self, default: str) -> str:
        """The session's model, or the service's configured one when it named none."""
        return self.model or default


class CompactionsRunning(BaseModel):
    """A session's compactions started and not yet ended (the `compactions_running`
    KV bucket): correlation id -> id of the generator running it. Whichever
    process runs them, this is what makes the session's state `compacting`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    running: dict[str, str] = Field(default_factory=dict)
