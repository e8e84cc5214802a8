"""How models differ, as in Ollama: which are there (404 otherwise), their
capabilities (tools, thinking), windows, the load on a first call (``--load-ms``),
the parallel slots per model (``--parallel``, logged for ``/_stub/slots``), and the
answers of ``/api/show``, ``/api/tags`` and ``/api/pull``."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from .chat_request import ChatRequest
from .common import (
    FIXED_TIMESTAMP,
    SLOT_LOG_LENGTH,
    ChatMessage,
    JSONObject,
    normalize_model,
    sleep_ns,
)
from .replies import Reply, is_summary_request, wants_thinking
from .responses import error_response


def model_details() -> JSONObject:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": "stub",
        "families": ["stub"],
        "parameter_size": "1B",
        "quantization_level": "Q4_0",
    }


def model_entry(name: str) -> JSONObject:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return {
        "name": name,
        "model": name,
        "modified_at": FIXED_TIMESTAMP,
        "size": 1_000_000 + int(digest[:5], 16),
        "digest": digest,
        "details": model_details(),
    }


DEFAULT_CAPABILITIES = ("completion", "tools")
KNOWN_CAPABILITIES = ("completion", "tools", "thinking", "vision", "insert", "embedding")
DEFAULT_CONTEXT_LENGTH = 131072
# A pull streams this many progress lines per layer, as Ollama reports a download.
PULL_STEPS = 4
PULL_LAYER_BYTES = 4_000_000


@dataclass
class ModelCatalogue:
    """Which models the stand-in has and what each can do (``--models``,
    ``--capabilities``, ``--context-length``, ``--parallel``, ``--load-ms``).

    Names are normalised (``name`` is ``name:latest``). ``served`` None means any
    name is there, as before these flags existed.
    """

    served: set[str] | None = None
    capabilities: dict[str, tuple[str, ...]] = field(default_factory=dict)
    context_length: dict[str, int] = field(default_factory=dict)
    parallel: int | None = None
    load_ms: float = 0.0
    # Older Ollama releases describe no capabilities in /api/show.
    show_capabilities: bool = True

    def has(self, model: str) -> bool:
        return self.served is None or normalize_model(model) in self.served

    def capabilities_of(self, model: str) -> tuple[str, ...]:
        return self.capabilities.get(normalize_model(model), DEFAULT_CAPABILITIES)

    def context_length_of(self, model: str) -> int:
        return self.context_length.get(normalize_model(model), DEFAULT_CONTEXT_LENGTH)

    def pulled(self, model: str) -> None:
        if self.served is not None:
            self.served.add(normalize_model(model))


def not_found_text(model: str) -> str:
    return f'model "{model}" not found, try pulling it first'


def model_refusal(catalogue: ModelCatalogue, request: ChatRequest) -> JSONResponse | None:
    """Ollama's answer to a chat request the model cannot take, if any: 404 for a
    model that is not there, 400 for tools offered to a model without them."""
    if not catalogue.has(request.model):
        return error_response(404, not_found_text(request.model))
    if request.tools and "tools" not in catalogue.capabilities_of(request.model):
        return error_response(400, f"{request.model} does not support tools")
    # Only for a model described by --capabilities: without the flag, any model
    # thinks when asked, as this stand-in always let it.
    described = normalize_model(request.model) in catalogue.capabilities
    lacks = "thinking" not in catalogue.capabilities_of(request.model)
    if described and lacks and wants_thinking(request.think):
        return error_response(400, f'"{request.model}" does not support thinking')
    return None


def thinks(catalogue: ModelCatalogue, request: ChatRequest) -> bool:
    """A thinking model thinks unless told ``think: false``; other models only when asked."""
    if "thinking" in catalogue.capabilities_of(request.model):
        return request.think is not False and request.think != "false"
    return wants_thinking(request.think)


def apply_thinking(catalogue: ModelCatalogue, request: ChatRequest, reply: Reply,
                   messages: Sequence[ChatMessage]) -> None:
    """What a thinking model does with its output budget. Asked for a summary
    while thinking, it spends the whole output on thinking and the content
    stays empty, as qwen3 and its kind do on long inputs."""
    if not thinks(catalogue, request):
        reply.thinking = ""
        return
    if not reply.thinking:
        reply.thinking = f"Considering {len(messages)} message(s) before answering."
    if "thinking" in catalogue.capabilities_of(request.model) and is_summary_request(messages):
        reply.thinking = f"{reply.thinking}\nDrafting: {reply.content}"
        reply.content = ""


class ModelSlots:
    """At most ``parallel`` requests in progress per model; the rest wait in
    arrival order (asyncio's semaphore is fair), as OLLAMA_NUM_PARALLEL does.

    ``log`` keeps, in order, when each chat request arrived, got a slot, sent
    its first chunk and gave its slot back, and whether it was a summary or an
    answer: which request waited behind which, without reading any clock."""

    def __init__(self, parallel: int | None) -> None:
        self._parallel = parallel
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.waiting: dict[str, int] = {}
        self.busy: dict[str, int] = {}
        self.log: deque[JSONObject] = deque(maxlen=SLOT_LOG_LENGTH)

    def note(self, model: str, event: str, kind: str, num_ctx: int | None = None) -> None:
        """`num_ctx` (of an arrival): Ollama reloads a model asked with another."""
        entry = {"model": normalize_model(model), "event": event, "kind": kind,
                 "at_s": time.monotonic()}
        if num_ctx is not None:
            entry["num_ctx"] = num_ctx
        self.log.append(entry)

    async def take(self, model: str, kind: str = "answer") -> Slot:
        key = normalize_model(model)
        if self._parallel is not None:
            semaphore = self._slots.setdefault(key, asyncio.Semaphore(self._parallel))
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                await semaphore.acquire()
            finally:
                self.waiting[key] -= 1
        self.busy[key] = self.busy.get(key, 0) + 1
        self.note(key, "started", kind)
        return Slot(self, key, kind)

    def give_back(self, key: str, kind: str) -> None:
        self.busy[key] -= 1
        self.note(key, "done", kind)
        if self._parallel is not None:
            self._slots[key].release()

    def as_json(self) -> JSONObject:
        return {"parallel": self._parallel, "waiting": dict(self.waiting),
                "in_progress": dict(self.busy), "log": list(self.log)}


class Slot:
    """One request's place; given back once, however its response ends."""

    def __init__(self, slots: ModelSlots, key: str, kind: str) -> None:
        self._slots: ModelSlots | None = slots
        self._key = key
        self.kind = kind
        self._first_chunk = True

    def first_chunk(self) -> None:
        if self._first_chunk and self._slots is not None:
            self._first_chunk = False
            self._slots.note(self._key, "first_chunk", self.kind)

    def release(self) -> None:
        if self._slots is not None:
            self._slots.give_back(self._key, self.kind)
            self._slots = None


class ModelLoads:
    """The first call to a model loads it (``--load-ms``); calls arriving while it
    loads wait for the same load, as they do in Ollama."""

    def __init__(self, load_ms: float) -> None:
        self._load_s = load_ms / 1000
        self._loads: dict[str, asyncio.Future[int]] = {}

    async def ensure_loaded(self, model: str) -> int:
        """Nanoseconds this request waited for the model to load (0 once loaded)."""
        if self._load_s <= 0:
            return 0
        key = normalize_model(model)
        load = self._loads.get(key)
        if load is None:
            load = self._loads[key] = asyncio.ensure_future(sleep_ns(self._load_s))
        if load.done():
            return 0
        started = time.perf_counter_ns()
        await asyncio.shield(load)
        return time.perf_counter_ns() - started


async def held_stream(chunks: AsyncIterator[bytes], slot: Slot) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            slot.first_chunk()
            yield chunk
    finally:
        slot.release()


def show_answer(catalogue: ModelCatalogue, model: str, default_num_ctx: int) -> JSONObject:
    answer: JSONObject = {
        "modelfile": f"# Modelfile generated by the ollama stand-in\nFROM {model}\n",
        "parameters": f"num_ctx                        {default_num_ctx}",
        "template": "{{ .System }}\n{{ .Prompt }}",
        "details": model_details(),
        "model_info": {"general.architecture": "stub",
                       "stub.context_length": catalogue.context_length_of(model)},
        "capabilities": list(catalogue.capabilities_of(model)),
        "modified_at": FIXED_TIMESTAMP,
    }
    if not catalogue.show_capabilities:
        del answer["capabilities"]
    return answer


def pull_progress(model: str) -> list[JSONObject]:
    """The status lines of ``ollama pull``: manifest, one layer's download, checks, success."""
    digest = "sha256:" + hashlib.sha256(model.encode()).hexdigest()
    lines: list[JSONObject] = [{"status": "pulling manifest"}]
    for step in range(PULL_STEPS + 1):
        lines.append({"status": f"pulling {digest[7:19]}", "digest": digest,
                      "total": PULL_LAYER_BYTES,
                      "completed": PULL_LAYER_BYTES * step // PULL_STEPS})
    lines += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"},
              {"status": "success"}]
    return lines
