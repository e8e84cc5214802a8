"""What the stand-in remembers between requests: statistics (``/_stub/stats``),
the models asked for, the prompt cache, and the events that release waiting requests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .common import JSONObject, normalize_model
from .directives import StubConfig
from .models import ModelLoads, ModelSlots


@dataclass
class ModelStats:
    requests: int = 0
    max_prompt_tokens: int = 0
    truncated: int = 0
    # Too long for the window, and asked not to be truncated: refused.
    refused_too_long: int = 0

    def as_json(self) -> JSONObject:
        return {
            "requests": self.requests,
            "max_prompt_tokens": self.max_prompt_tokens,
            "truncated": self.truncated,
            "refused_too_long": self.refused_too_long,
        }


@dataclass
class StubState:
    config: StubConfig
    totals: ModelStats = field(default_factory=ModelStats)
    per_model: dict[str, ModelStats] = field(default_factory=dict)
    # Insertion-ordered set of every model asked for, for /api/tags; survives resets.
    seen_models: dict[str, None] = field(default_factory=dict)
    # Per normalised model: the previous request's (tools, messages) fingerprints.
    prompt_cache: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    # Set when the server is asked to exit, to release requests of the "hang" quirk.
    shutdown_event: asyncio.Event = field(default_factory=asyncio.Event)
    # Set, and replaced by a fresh one, on every config change: held requests wait on it.
    config_changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Streamed answers whose client went away before their end (a stopped
    # answer): each one's generation ended there.
    streams_cut: int = 0

    def announce_config_change(self) -> None:
        changed, self.config_changed = self.config_changed, asyncio.Event()
        changed.set()
    slots: ModelSlots = field(init=False)
    loads: ModelLoads = field(init=False)

    def __post_init__(self) -> None:
        self.slots = ModelSlots(self.config.models.parallel)
        self.loads = ModelLoads(self.config.models.load_ms)

    def stats_json(self) -> JSONObject:
        stats = self.totals.as_json()
        stats["models"] = {name: entry.as_json() for name, entry in self.per_model.items()}
        stats["streams_cut"] = self.streams_cut
        return stats

    def reset(self) -> None:
        self.totals = ModelStats()
        self.per_model.clear()
        self.prompt_cache.clear()
        self.streams_cut = 0

    def record_prompt(self, model: str, prompt_tokens: int, truncated: bool,
                      refused: bool = False) -> None:
        """Per-model bookkeeping; the total request count is taken on arrival instead."""
        entry = self.per_model.setdefault(model, ModelStats())
        entry.requests += 1
        self.seen_models.setdefault(normalize_model(model), None)
        for stats in (entry, self.totals):
            stats.max_prompt_tokens = max(stats.max_prompt_tokens, prompt_tokens)
            stats.truncated += int(truncated)
            stats.refused_too_long += int(refused)
