"""A session's durable settings and calibration (the `sessions` KV bucket)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.envelope import Timestamp, utc_now

MAX_SYSTEM_PROMPT_CHARS = 200_000
# Fields stored records may still carry from an earlier version. `compactions`
# counted a session's compactions, which the history's snapshot counts itself.
RETIRED_FIELDS = frozenset({"compactions"})


class CountBasis(BaseModel):
    """The provider's last count of a whole prompt: its text's characters and
    extra UTF-8 bytes, and the tokens charged. A later count of a prompt of
    another make-up is solved against it for the rate of dense scripts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chars: float = Field(ge=0)
    extra_bytes: float = Field(ge=0)
    tokens: float = Field(gt=0)


class SessionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    # Pinned outside the history: sent byte-identical on every call.
    system: str = Field(default="", max_length=MAX_SYSTEM_PROMPT_CHARS)
    # None: the generator's configured model.
    model: str | None = Field(default=None, max_length=200)
    auto_compact: bool = True
    created_at: Timestamp = Field(default_factory=utc_now)
    # The provider's own tokens-per-character from its last usable report.
    tokens_per_char: float | None = Field(default=None, gt=0)
    # What each UTF-8 byte beyond a character's first adds (CJK and other
    # dense scripts), once learnt; None: charged at a cautious rate.
    tokens_per_extra_byte: float | None = Field(default=None, ge=0)
    count_basis: CountBasis | None = None
    # The window the session's model was trained for, as the generator last
    # read it from the model server; a smaller NUM_CTX wins. None: not known.
    context_length: int | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _without_retired_fields(cls, data: Any) -> Any:
        """Records written before a field was retired still load: the field is
        dropped on read, and so never written again. Any other unknown field
        is still refused."""
        if isinstance(data, dict) and RETIRED_FIELDS & data.keys():
            return {k: v for k, v in data.items() if k not in RETIRED_FIELDS}
        return data

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
