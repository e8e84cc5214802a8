"""Ollama-compatible stand-in HTTP server for tests and benchmarks.

It speaks enough of the Ollama REST API (``/api/chat``, ``/api/tags``, ``/api/show``,
``/api/version``, ``/api/pull``) for the real ``ollama.AsyncClient`` to talk to it, and answers
deterministically from the input so tests can assert on exact replies and token counts.
It also reproduces the Ollama behaviours the chat backend has to survive: silent
context truncation, prompt-cache token counts, thinking-only replies, 500s and hangs,
and the way models differ: some are not pulled (404), some lack tools (400), thinking
models think unless told not to, each has its own window, a first call loads the model,
and a model serves only so many requests at once (``--models``, ``--capabilities``,
``--context-length``, ``--load-ms``, ``--parallel``).

Run it with ``python -m scripts.ollama_stub --port 11435`` (see ``--help``).
Control endpoints under ``/_stub/`` expose statistics and change behaviour live.

The modules, by concern:

- ``server``: the HTTP routes and the path of one chat request;
- ``tokens``: token counting and the truncation to ``num_ctx``;
- ``replies``: what is answered, and the ``!tool``/``!long``/``!summary`` prompt markers;
- ``quirks``: the Ollama behaviours switched on by ``--quirk``;
- ``models``: how models differ (catalogue, capabilities, loads, parallel slots);
- ``directives``: the live test controls of ``/_stub/config`` (held and paused models, latency...);
- ``chat_request``, ``responses``, ``state``, ``common``, ``cli``: parsing, answer
  shapes, bookkeeping, shared names, the command line.
"""

from .cli import main
from .directives import StubConfig
from .replies import echo_reply, filler_text
from .server import build_app
from .tokens import count_completion_tokens, count_prompt_tokens, truncate_to_fit

__all__ = [
    "StubConfig",
    "build_app",
    "count_completion_tokens",
    "count_prompt_tokens",
    "echo_reply",
    "filler_text",
    "main",
    "truncate_to_fit",
]
