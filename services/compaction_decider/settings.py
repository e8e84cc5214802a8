"""Decider settings (environment variables or the YAML file; see README)."""

from __future__ import annotations

from pydantic import Field

from services.shared.settings import ServiceSettings


class DeciderSettings(ServiceSettings):
    # Fraction of the prompt budget at which compaction fires; 0 disables it.
    compaction_threshold: float = Field(default=0.8, ge=0, le=1)
    compaction_cooldown_s: float = Field(default=30.0, ge=0)
    # A compaction must be able to free at least this fraction of the budget.
    compaction_min_relief: float = Field(default=0.1, ge=0, le=1)
    # An automatic request with no result after this long is taken as lost
    # (publish or result missed) and the session may be asked for again. Above
    # the generator's defaults for a summary and the lock wait before it
    # (600 + 30 s): asked again sooner, a slow summary would be asked for twice.
    compaction_result_timeout_s: float = Field(default=660.0, gt=0)
    output_headroom: int | None = Field(default=None, ge=0)
