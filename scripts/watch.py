"""Watch the system think: one readable line per message on its subjects.

    python -m scripts.watch                          # every subject of the system
    python -m scripts.watch --session 3f2a9c         # one session (a prefix is enough)
    python -m scripts.watch --subject 'compaction.>' # NATS subject patterns, repeatable
    python -m scripts.watch --json                   # the raw envelopes, one per line

It reads NATS_URL (and CONFIG_FILE) as the services do. Colour on a
terminal only; `--no-color` turns it off there too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from rich.console import Console
from rich.text import Text

from schemas.subjects import SYSTEM_SUBJECTS
from scripts.nats_passwords import admin_options
from scripts.run import NATS_PASSWORDS
from scripts.terminal_text import shown
from services.shared.bus import connect, parse_json, round_trip
from services.shared.logging import configure_logging
from services.shared.runner import main as run_main
from services.shared.settings import ServiceSettings, shown_url, url_has_credentials

STYLES = {"chat": "cyan", "generator": "magenta", "response": "green",
          "compaction": "yellow", "tool": "blue", "system": "bold red"}
Payload = dict[str, Any]


@dataclass(frozen=True)
class Line:
    time: str
    subject: str
    sender: str
    session: str
    detail: str

    def text(self) -> Text:
        style = STYLES.get(self.subject.split(".", 1)[0], "white")
        line = Text()
        line.append(f"{shown(self.time)} ", style="dim")
        # Every part as text a terminal shows, not obeys: any client may publish.
        line.append(f"{shown(self.subject):<28} ", style=style)
        line.append(f"{shown(self.sender):<20} ", style="dim")
        line.append(f"{shown(self.session):<8} ", style="bold")
        line.append(shown(self.detail))
        return line


def short(sid: str | None) -> str:
    return (sid or "-")[:8]


def clock(timestamp: Any) -> str:
    """HH:MM:SS.mmm of an ISO timestamp, or what was there."""
    text = str(timestamp or "")
    return text[11:23] if len(text) >= 23 and text[10] == "T" else text or "-"


def _n(value: Any) -> str:
    return "?" if value is None else str(value)


def _state(p: Payload) -> str:
    return f"{p.get('from_state')} → {p.get('to_state')} ({p.get('action')})"


def _result(p: Payload) -> str:
    status = p.get("status", "completed")
    sizes = f"{_n(p.get('tokens_before'))} → {_n(p.get('tokens_after'))} tokens"
    trigger = "auto" if p.get("auto") else "manual"
    why = f": {p['error']}" if p.get("error") else ""
    return f"{status} {p.get('level', '')} {trigger}, {sizes}{why}"


def _generation(p: Payload) -> str:
    return (f"prompt {_n(p.get('prompt_tokens'))} · completion "
            f"{_n(p.get('completion_tokens'))} tokens · {_n(p.get('sent_chars'))} chars sent"
            f" · window {_n(p.get('num_ctx'))} · {round(p.get('duration_ms') or 0)} ms")


def _request(p: Payload) -> str:
    trigger = "auto" if p.get("auto") else "manual"
    return f"{p.get('level', 'gentle')} {trigger}: {p.get('reason', '')}"


def _event(p: Payload) -> str:
    return f"{p.get('event')} {p.get('level')} at {_n(p.get('tokens_before'))} tokens"


def _reply(p: Payload) -> str:
    if p.get("error"):
        return f"error {p.get('error_code')}: {p['error']}"
    return (f"{len(p.get('reply') or '')} chars, prompt {_n(p.get('prompt_tokens'))}"
            f" · completion {_n(p.get('completion_tokens'))} tokens")


def _query(p: Payload) -> str:
    content = str(p.get("content", ""))
    return repr(content[:60] + ("…" if len(content) > 60 else ""))


def _token(p: Payload) -> str:
    return f"#{p.get('index')} {p.get('text', '')!r}"


def _error(p: Payload) -> str:
    return f"{p.get('code')}: {p.get('message')} (on {p.get('subject')})"


def _tool_call(p: Payload) -> str:
    return f"{p.get('name')}({json.dumps(p.get('arguments', {}))[:60]})"


def _tool_result(p: Payload) -> str:
    return f"{p.get('name')}: {p.get('error') or p.get('content')}"


def _unknown(p: Payload) -> str:
    return json.dumps(p)[:120]


DESCRIBE: dict[str, Callable[[Payload], str]] = {
    "generator.state": _state, "compaction.result": _result, "compaction.request": _request,
    "compaction.event": _event, "response.generation": _generation, "chat.reply": _reply,
    "chat.query": _query, "chat.token": _token, "error": _error, "tool.call": _tool_call,
    "tool.result": _tool_result,
}


def describe(subject: str, data: bytes) -> Line:
    """One line for a message, whatever it holds (a non-envelope is shown raw)."""
    try:
        env = parse_json(data)
    except (ValueError, RecursionError):
        env = None
    if not isinstance(env, dict) or not isinstance(env.get("payload"), dict):
        return Line("-", subject, "-", "-", data[:120].decode(errors="replace"))
    payload: Payload = env["payload"]
    show = DESCRIBE.get(str(env.get("message_type")), _unknown)
    # OverflowError: JSON's numbers too big for a float are read as infinity,
    # which no int holds (a duration's `round`).
    try:
        detail = show(payload)
    except (TypeError, ValueError, KeyError, RecursionError, OverflowError) as err:
        detail = f"(unreadable payload: {err})"
    return Line(clock(env.get("timestamp")), subject, str(env.get("sender_id", "-")),
                short(str(env.get("session_id") or "")), detail)


def session_of(data: bytes) -> str | None:
    with contextlib.suppress(ValueError, AttributeError):
        sid = parse_json(data).get("session_id")
        return str(sid) if sid else None
    return None


class BrokenPipeRaisingConsole(Console):
    """A Console that leaves a closed stdout to its caller: rich's own answer
    is SystemExit(1), which out of a nats-py callback ends the process with a
    traceback and a status of failure."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of stdout is gone")


class Printer:
    def __init__(self, console: Console, session: str | None, raw: bool) -> None:
        self._console = console
        self._session = session
        self._raw = raw
        # Set when whoever read stdout has gone (`| head`): time to stop.
        self.reader_gone = asyncio.Event()

    async def on_message(self, msg: Msg) -> None:
        if self._session and not (session_of(msg.data) or "").startswith(self._session):
            return
        try:
            self._print(msg)
        except BrokenPipeError:
            # Python flushes stdout once more as it exits: into nothing now,
            # or that flush reports the closed pipe again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            self.reader_gone.set()

    def _print(self, msg: Msg) -> None:
        if self._raw:
            sys.stdout.write(msg.data.decode(errors="replace") + "\n")
            sys.stdout.flush()
        else:
            self._console.print(describe(msg.subject, msg.data).text(), soft_wrap=True)


def credentials(settings: ServiceSettings, kept: Path) -> dict[str, Any]:
    """nats-py's options for the credentials given, in the settings or in
    NATS_URL; only when none are, those `make run` keeps for its operator at
    `kept` (if any). nats-py puts options given before the URL's own, so a
    kept password would replace a URL's right one."""
    given = settings.nats_options()
    if given or url_has_credentials(settings.nats_url):
        return given
    return admin_options(kept)


async def watch(args: argparse.Namespace) -> None:
    settings = ServiceSettings()
    # What it says of its own connection goes to stderr, like any service's
    # log: the messages it shows are stdout's alone.
    configure_logging("watch", settings.log_level, settings.log_format)
    console = BrokenPipeRaisingConsole(no_color=args.no_color, highlight=False)
    nc = await connect(settings.nats_url, "watch", settings.nats_connect_timeout_s,
                       options=credentials(settings, NATS_PASSWORDS))
    printer = Printer(console, args.session, args.json)
    for subject in args.subject or SYSTEM_SUBJECTS:
        await nc.subscribe(subject, cb=printer.on_message)
    await round_trip(nc)
    # On stderr, so `--json` output stays one envelope per line.
    Console(stderr=True, no_color=args.no_color).print(Text(
        f"watching {', '.join(args.subject or SYSTEM_SUBJECTS)} on {shown_url(settings.nats_url)} "
        "(Ctrl-C stops)", style="dim"), soft_wrap=True)
    try:
        # Until Ctrl-C, SIGTERM or the reader of stdout going: then, like any
        # Unix filter, a quiet exit with status 0.
        await printer.reader_gone.wait()
    finally:
        await nc.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.watch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--session", help="only this session (an id or its prefix)")
    parser.add_argument("--subject", action="append",
                        help="NATS subject pattern to watch (repeatable; default: all of ours)")
    parser.add_argument("--json", action="store_true", help="print each raw envelope")
    parser.add_argument("--no-color", action="store_true", help="no colour even on a terminal")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run_main(watch(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
