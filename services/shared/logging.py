"""structlog set-up: JSON lines when not on a terminal, readable when on one.

Services bind `service` once at start and `session_id` / `correlation_id` per
message with `structlog.contextvars.bound_contextvars`, which follows asyncio
tasks, so every line a handler logs carries them without passing a logger.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Annotated, Literal, TextIO, cast

import structlog
from pydantic import BeforeValidator

LogFormat = Literal["auto", "json", "console"]


def _lower_case(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


# A level no logger knows was read as info: a typo in LOG_LEVEL hid the debug
# lines asked for. Any case, as Python's own names are written.
LogLevel = Annotated[Literal["debug", "info", "warning", "error", "critical"],
                     BeforeValidator(_lower_case)]


def configure_logging(service: str, level: str = "info", fmt: LogFormat = "auto") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, Unfailing(sys.stderr))),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)


class Unfailing:
    """A stream whose writes never raise. Once the terminal `make run` ran in
    is closed, writing to it fails (EIO); a line then has nowhere to go, and a
    service draining on that SIGHUP must not fail over its own log."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()
