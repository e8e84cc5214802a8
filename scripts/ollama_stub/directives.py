"""The test controls: the live configuration that ``POST /_stub/config`` changes.

Quirks, ``ms_per_token``, per-model latency, ``chars_per_token``,
``default_num_ctx``, held models (requests for a held model wait until it is let
go: a call under way for exactly as long as a test needs) and paused models (a
streamed answer sends its first piece, then waits until the model is let go: an
answer visibly being written for as long as a test needs). An update is
validated whole before any of it applies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .chat_request import BadRequest
from .common import JSONObject, first_of, normalize_model
from .models import ModelCatalogue
from .quirks import QUIRKS

if TYPE_CHECKING:  # a type only: the state module imports this one
    from .state import StubState


@dataclass
class StubConfig:
    """Behaviour of the stand-in; mutable so ``/_stub/config`` can change it live."""

    host: str = "127.0.0.1"
    port: int = 11435
    chars_per_token: float = 4.0
    ms_per_token: float = 0.0
    model_latency: dict[str, float] = field(default_factory=dict)
    quirks: set[str] = field(default_factory=set)
    default_num_ctx: int = 2048
    # Requests for these models wait until they are let go (a config change):
    # a call that is under way for exactly as long as a test needs it to be.
    held_models: set[str] = field(default_factory=set)

    # Streamed answers of these models stop after their first piece until let go.
    paused_models: set[str] = field(default_factory=set)

    def holds(self, model: str) -> bool:
        return _named(model, self.held_models)

    def pauses(self, model: str) -> bool:
        return _named(model, self.paused_models)

    # Set at start-up only (command-line flags), so not part of ``as_json``.
    models: ModelCatalogue = field(default_factory=lambda: ModelCatalogue())

    def latency_ms(self, model: str) -> float:
        """Fixed per-request latency; ``name`` and ``name:latest`` are the same model."""
        wanted = normalize_model(model)
        for name, millis in self.model_latency.items():
            if normalize_model(name) == wanted:
                return millis
        return 0.0

    def as_json(self) -> JSONObject:
        return {
            "quirks": sorted(self.quirks),
            "ms_per_token": self.ms_per_token,
            "model_latency": dict(self.model_latency),
            "chars_per_token": self.chars_per_token,
            "default_num_ctx": self.default_num_ctx,
            "held_models": sorted(self.held_models),
            "paused_models": sorted(self.paused_models),
        }


def _named(model: str, names: set[str]) -> bool:
    return normalize_model(model) in {normalize_model(name) for name in names}


async def wait_while_held(state: StubState, model: str) -> None:
    """Keep a request for a held model waiting until the model is let go, or the
    stand-in exits."""
    await _wait_while(state, lambda: state.config.holds(model))


async def wait_while_paused(state: StubState, model: str) -> None:
    """Keep a paused model's stream waiting until the model is let go, or the
    stand-in exits."""
    await _wait_while(state, lambda: state.config.pauses(model))


async def _wait_while(state: StubState, condition: Callable[[], bool]) -> None:
    while condition() and not state.shutdown_event.is_set():
        await first_of(state.config_changed.wait(), state.shutdown_event.wait())


def _number(value: Any, key: str, positive: bool) -> float:
    bound_ok = isinstance(value, int | float) and (value > 0 if positive else value >= 0)
    if isinstance(value, bool) or not bound_ok:
        raise BadRequest(f"{key} must be a number {'> 0' if positive else '>= 0'}")
    return float(value)


def _quirk_list(value: Any) -> set[str]:
    if not isinstance(value, list) or not all(isinstance(q, str) for q in value):
        raise BadRequest("quirks must be a list of strings")
    unknown = sorted(set(value) - set(QUIRKS))
    if unknown:
        raise BadRequest(f"unknown quirk(s) {unknown}; known: {', '.join(QUIRKS)}")
    return set(value)


def _latency_map(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise BadRequest("model_latency must be an object of model name -> milliseconds")
    return {str(name): _number(ms, f"model_latency[{name}]", False) for name, ms in value.items()}


def _model_set(value: Any, key: str) -> set[str]:
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise BadRequest(f"{key} must be a list of model names")
    return set(value)


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{key} must be an integer >= 1")
    return value


def apply_config_update(config: StubConfig, body: Any) -> None:
    """Validate the whole update first, then apply it, so a bad field changes nothing."""
    if not isinstance(body, dict):
        raise BadRequest("config body must be a JSON object")
    known = {"quirks", "ms_per_token", "model_latency", "chars_per_token", "default_num_ctx",
             "held_models", "paused_models"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown config key(s) {unknown}; known: {', '.join(sorted(known))}")
    updates: JSONObject = {}
    if "quirks" in body:
        updates["quirks"] = _quirk_list(body["quirks"])
    if "ms_per_token" in body:
        updates["ms_per_token"] = _number(body["ms_per_token"], "ms_per_token", False)
    if "chars_per_token" in body:
        updates["chars_per_token"] = _number(body["chars_per_token"], "chars_per_token", True)
    if "model_latency" in body:
        updates["model_latency"] = _latency_map(body["model_latency"])
    if "default_num_ctx" in body:
        updates["default_num_ctx"] = _positive_int(body["default_num_ctx"], "default_num_ctx")
    for key in ("held_models", "paused_models"):
        if key in body:
            updates[key] = _model_set(body[key], key)
    for key, value in updates.items():
        setattr(config, key, value)
