"""What each model can do, as its server describes it (`/api/show`), read once
per model and corrected when a call says otherwise.

Models differ: some have no tool support (a request offering tools is refused),
thinking models think unless told not to, and each has the window it was
trained for, which a larger `num_ctx` would only overrun.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import ollama
import structlog

log = structlog.get_logger()

ThinkMode = Literal["auto", "on", "off"]
# What Ollama assumed of every model before it described them.
ASSUMED_CAPABILITIES = frozenset({"completion", "tools"})


@dataclass(frozen=True)
class ModelFacts:
    capabilities: frozenset[str] = ASSUMED_CAPABILITIES
    # The window the model was trained for; None when the server does not say.
    context_length: int | None = None

    @property
    def tools(self) -> bool:
        return "tools" in self.capabilities

    @property
    def thinking(self) -> bool:
        return "thinking" in self.capabilities

    def without(self, capability: str) -> ModelFacts:
        return replace(self, capabilities=self.capabilities - {capability})


ASSUMED = ModelFacts()


@dataclass(frozen=True)
class TimeLimits:
    """A model call's two limits: until its first token (the model may have to
    load, then read a long prompt), then between two tokens while it streams."""

    first_token_s: float
    gap_s: float

    def first_token_message(self) -> str:
        return (f"the model sent nothing within {self.first_token_s:g} s "
                "(loading it and reading the prompt included)")

    def gap_message(self) -> str:
        return f"the model stopped for more than {self.gap_s:g} s in the middle of its answer"


def normalized(model: str) -> str:
    """Ollama takes an untagged name for `:latest`."""
    return model if ":" in model.rsplit("/", 1)[-1] else f"{model}:latest"


def context_length_of(model_info: Mapping[str, Any] | None) -> int | None:
    """`<arch>.context_length` of `/api/show`'s model_info."""
    if not model_info:
        return None
    arch = model_info.get("general.architecture")
    value = model_info.get(f"{arch}.context_length")
    if value is None:
        value = next((v for k, v in model_info.items() if k.endswith(".context_length")), None)
    return value if isinstance(value, int) and value > 0 else None


def facts_from_show(shown: ollama.ShowResponse) -> ModelFacts:
    capabilities = (frozenset(shown.capabilities) if shown.capabilities is not None
                    else ASSUMED_CAPABILITIES)
    return ModelFacts(capabilities, context_length_of(shown.modelinfo))


def think_field(mode: ThinkMode, facts: ModelFacts) -> bool | None:
    """The `think` to send: only to a thinking model (others refuse it), and
    none for "auto", which leaves the model's own default."""
    if not facts.thinking or mode == "auto":
        return None
    return mode == "on"


def capped_window(num_ctx: int, facts: ModelFacts) -> int:
    """The window to use: the one asked for, or the model's own if smaller."""
    if facts.context_length is None:
        return num_ctx
    return min(num_ctx, facts.context_length)


class ModelBook:
    """Facts per model, each asked for once (callers arriving meanwhile share the
    question); a failed question is not kept, so the next call asks again."""

    def __init__(self, show: Callable[[str], Awaitable[ModelFacts]]) -> None:
        self._show = show
        self._known: dict[str, ModelFacts] = {}
        self._asking: dict[str, asyncio.Future[ModelFacts]] = {}
        self._capped: set[tuple[str, int]] = set()

    async def facts(self, model: str) -> ModelFacts:
        key = normalized(model)
        known = self._known.get(key)
        if known is not None:
            return known
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._show(model))
            asking.add_done_callback(functools.partial(self._settle, key))
        return await asyncio.shield(asking)

    def _settle(self, key: str, done: asyncio.Future[ModelFacts]) -> None:
        self._asking.pop(key, None)
        if not done.cancelled() and done.exception() is None:
            self._known[key] = done.result()

    def learn(self, model: str, facts: ModelFacts,
              refusal: ollama.ResponseError) -> ModelFacts | None:
        """Correct the facts after the server refused a call. Returns the facts
        to try once more with, or None when trying again would not help."""
        key = normalized(model)
        text = str(refusal.error)
        if refusal.status_code == 404:
            self._known.pop(key, None)  # gone, or renamed: ask afresh next time
            return None
        for capability, said in (("tools", "does not support tools"),
                                 ("thinking", "does not support thinking")):
            if refusal.status_code == 400 and said in text and capability in facts.capabilities:
                log.warning("model_lacks_capability", model=model, capability=capability)
                corrected = facts.without(capability)
                self._known[key] = corrected
                return corrected
        return None

    def window(self, model: str, num_ctx: int, facts: ModelFacts) -> int:
        window = capped_window(num_ctx, facts)
        if window < num_ctx and (normalized(model), num_ctx) not in self._capped:
            self._capped.add((normalized(model), num_ctx))
            log.warning("num_ctx_capped", model=model, num_ctx=num_ctx, model_window=window)
        return window
