"""A terminal chat against the gateway: streamed answers, compaction, state.

    python -m scripts.chat                          # a new session
    python -m scripts.chat --session 3f2a9c...      # go on with one
    python -m scripts.chat --url http://host:8080   # another gateway (or GATEWAY_URL)

Type a message and Enter. Commands: `/retry` (a fresh answer to the last
message), `/compact [instructions]`, `/state`, `/transcript`, `/export [file]`
(the whole transcript, Markdown, or JSON for a `.json` file), `/again`,
`/help`, `/quit` (or Ctrl-D). Each message (and retry) goes under an
Idempotency-Key; after a failure that leaves its fate unknown (no
answer in time, the connection lost, NATS away), `/again` sends it once more
under the same key, and it is answered once. After each answer a context line
shows how full the window is. On a terminal the input line has history and
editing (prompt_toolkit); from a pipe, lines are read as they come. A gateway
with a token is opened with GATEWAY_TOKEN set to it in the environment
(`auto`: the one `make run` keeps under DATA_DIR).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.text import Text

from scripts.terminal_text import shown

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_URL = "http://127.0.0.1:8080"
HELP = ("Commands: /retry · /compact [instructions] · /state · /transcript · /export [file] · "
        "/again · /help · /quit\n"
        "Anything else is sent as a message; one that starts with / is sent as //...")
Event = tuple[str, Any]
# Failures after which a message may or may not have been taken; the page
# (services/gateway/static/answer.js) offers Send again after the same ones.
# An error status without the gateway's JSON (a proxy's) reads as http_<status>.
UNKNOWN_OUTCOME = frozenset({"network_error", "stream_ended", "nats_unavailable",
                             "reply_timeout", "gateway_stopping",
                             "http_502", "http_503", "http_504"})


@dataclass(frozen=True)
class Turn:
    """A message sent, or a retry of the last one (no content), under its key."""

    content: str | None
    # Its own key, kept for sending it again (/again).
    key: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def path(self) -> str:
        return "retry" if self.content is None else "messages"

    @property
    def body(self) -> dict[str, Any]:
        return {} if self.content is None else {"content": self.content}


class ChatError(Exception):
    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def sse_events(lines: Iterator[str]) -> Iterator[Event]:
    """(event, data) of a server-sent event stream; comments as ("", text)."""
    name, data = "message", []
    for line in lines:
        if line.startswith(":"):
            yield "", line[1:].strip()
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif not line and data:
            yield name, json.loads("\n".join(data))
            name, data = "message", []


def failure(response: httpx.Response) -> ChatError:
    """What a refusal says; a streamed response is read whole first."""
    response.read()
    try:
        err = response.json()["error"]
        return ChatError(f"{err['code']}: {err['message']}", err["code"])
    except (ValueError, KeyError, TypeError):
        return ChatError(f"HTTP {response.status_code}: {response.text[:200]}",
                         f"http_{response.status_code}")


class Chat:
    def __init__(self, client: httpx.Client, console: Console) -> None:
        self.client = client
        self.out = console
        self.sid = ""
        # The last message (or retry) whose fate is unknown: what /again sends.
        self.unsure: Turn | None = None

    def open(self, sid: str | None) -> None:
        if sid:
            self.session(sid)  # fails clearly on an unknown id
            self.sid = sid
        else:
            response = self.client.post("/api/sessions", json={})
            if response.status_code != 201:
                raise failure(response)
            self.sid = response.json()["session_id"]
        self.out.print(Text(f"session {self.sid}  (/help for commands)", style="bold"))

    def session(self, sid: str | None = None) -> dict[str, Any]:
        response = self.client.get(f"/api/sessions/{sid or self.sid}")
        if response.status_code != 200:
            raise failure(response)
        body: dict[str, Any] = response.json()
        return body

    def handle(self, line: str) -> bool:
        """Act on one input line; False when the user is done."""
        command, _, rest = line.strip().partition(" ")
        actions: dict[str, Callable[[str], None]] = {
            "/compact": self.compact, "/state": self.state, "/transcript": self.transcript,
            "/again": self.again, "/retry": self.retry, "/export": self.export,
            "/help": lambda _: self.out.print(HELP)}
        if command in ("/quit", "/exit"):
            return False
        if line.lstrip().startswith("//"):  # a message that starts with a slash
            self.send(Turn(line.lstrip()[1:]))
        elif command in actions:
            actions[command](rest.strip())
        elif command.startswith("/"):
            self.out.print(Text(f"unknown command {command}; /help lists them", style="red"))
        elif line.strip():
            self.send(Turn(line))
        return True

    def retry(self, _: str = "") -> None:
        """A fresh answer to the last message; the one it replaces stays in the
        transcript, out of the model's context."""
        self.send(Turn(None))

    def send(self, turn: Turn) -> None:
        try:
            self.stream_answer(turn)
        except KeyboardInterrupt:  # Ctrl-C while it answers: stop that answer, not the chat
            self.unsure = turn
            self.stop_answer(turn)
            return
        except (ChatError, httpx.TransportError) as err:
            code = err.code if isinstance(err, ChatError) else "network_error"
            if code not in UNKNOWN_OUTCOME:
                raise
            self.unsure = turn
            raise ChatError(f"{err}; /again sends it once more, answered once", code) from err
        self.unsure = None
        self.context_line()

    def stop_answer(self, turn: Turn) -> None:
        """The answer to the message (or retry) sent under its key, never
        another client's."""
        self.out.print()
        response = self.client.post(f"/api/sessions/{self.sid}/stop",
                                    json={"retry": turn.content is None},
                                    headers={"Idempotency-Key": turn.key})
        if response.status_code == 202 and response.json().get("status") == "withdrawn":
            self.unsure = None  # never answered, nothing kept: sent again, it is a new message
            self.out.print(Text("withdrawn before its turn: not answered, and nothing of it "
                                "kept", style="yellow"))
            return
        if response.status_code == 202:
            said = "stopping: the answer is kept as far as it was written"
        elif response.status_code == 409:
            said = "nothing was being written for it: its answer may have just been written"
        else:
            said = f"could not stop: {failure(response)}"
        self.out.print(Text(f"{said}; /again shows what became of it", style="yellow"))

    def again(self, _: str = "") -> None:
        if self.unsure is None:
            self.out.print("nothing to send again: every message so far was answered or refused")
            return
        self.send(self.unsure)

    def stream_answer(self, turn: Turn) -> None:
        self.out.print(Text("assistant: ", style="bold green"), end="")
        with self.client.stream("POST", f"/api/sessions/{self.sid}/{turn.path}",
                                json=turn.body,
                                headers={"Accept": "text/event-stream",
                                         "Idempotency-Key": turn.key}) as response:
            if response.status_code != 200:
                raise failure(response)
            streamed = False
            for name, data in sse_events(response.iter_lines()):
                if name == "token":
                    self.out.print(shown(data["text"]), end="", markup=False, highlight=False)
                    streamed = True
                elif name == "restart":
                    self.out.print(Text("\n(generating again)\nassistant: ", style="yellow"),
                                   end="")
                elif name == "error":
                    self.out.print()
                    error = data["error"]
                    raise ChatError(f"{error['code']}: {error['message']}", error["code"])
                elif name == "done":
                    if not streamed:  # answered whole: stored already, or sent once before
                        self.out.print(shown(data["reply"]), end="", markup=False,
                                       highlight=False)
                    break
            else:
                self.out.print()
                raise ChatError("stream_ended: the answer's stream ended before the answer did",
                                "stream_ended")
        self.out.print()

    def context_line(self) -> None:
        s = self.session()
        share = 100 * s["token_count"] / s["budget"] if s["budget"] else 0.0
        self.out.print(Text(
            f"context: {s['token_count']} / {s['budget']} tokens ({share:.0f} % of the budget, "
            f"window {s['num_ctx']}) · {len(s['messages'])} messages · "
            f"{s['compactions']} compactions", style="dim"))

    def compact(self, instructions: str) -> None:
        """Ask for a compaction and follow it on the live feed to its result
        (Ctrl-C stops following it; the compaction goes on)."""
        try:
            self.follow_compaction({"instructions": instructions} if instructions else {})
        except KeyboardInterrupt:
            self.out.print(Text("\nno longer following the compaction; it goes on, and "
                                "/state tells when it is done", style="yellow"))
            return
        self.context_line()

    def follow_compaction(self, body: dict[str, str]) -> None:
        with self.client.stream("GET", "/api/events", params={"session_id": self.sid},
                                timeout=httpx.Timeout(30, read=None)) as events:
            if events.status_code != 200:  # refused (too many listeners, say): no compaction
                raise failure(events)
            for name, data in sse_events(events.iter_lines()):
                if name == "" and data == "connected":  # subscribed: nothing is missed
                    response = self.client.post(f"/api/sessions/{self.sid}/compact", json=body)
                    if response.status_code != 202:
                        raise failure(response)
                    self.out.print(Text("compaction requested", style="yellow"))
                elif name == "compaction.event":
                    self.out.print(Text("compacting…", style="yellow"))
                elif name == "compaction.result":
                    self.out.print(Text(shown(result_text(data["payload"])), style="yellow"))
                    break
            else:
                self.out.print(Text("the live feed ended before the compaction's result; "
                                    "/state tells when it is done", style="yellow"))

    def state(self, _: str = "") -> None:
        s = self.session()
        self.out.print(Text(shown(f"state {s['state']} (phase {s['phase']}) · model {s['model']} · "
                                  f"auto-compact {'on' if s['auto_compact'] else 'off'}")))
        self.context_line()

    def transcript(self, _: str = "") -> None:
        after: str | None = ""
        response = self.client.get(f"/api/sessions/{self.sid}/transcript")
        while response.status_code == 200:
            page = response.json()
            for item in page.get("items", []):
                self.print_item(item)
            after = page.get("next")
            if not after:
                return
            response = self.client.get(f"/api/sessions/{self.sid}/transcript",
                                       params={"after": after})
        if after != "":
            self.out.print(Text(f"(the rest of the transcript could not be read: HTTP "
                                f"{response.status_code})", style="dim"))
            return
        # No full transcript from this gateway: what the model sees now.
        self.out.print(Text("(this gateway has no transcript endpoint: showing the current "
                            "context, the summary standing for what was compacted)",
                            style="dim"))
        s = self.session()
        if s.get("summary"):
            self.print_message({"role": "summary", "content": s["summary"]})
        for message in s["messages"]:
            self.print_message(message)

    def export(self, name: str = "") -> None:
        """The whole transcript into a file (`session-<id>.md` by default),
        written as the gateway streams it; JSON when the name ends in .json."""
        path = Path(name or f"session-{self.sid}.md").expanduser()
        form = "json" if path.suffix.lower() == ".json" else "markdown"
        with self.client.stream("GET", f"/api/sessions/{self.sid}/export",
                                params={"format": form}) as response:
            if response.status_code != 200:
                raise failure(response)
            with path.open("wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
        self.out.print(Text(f"transcript written to {path} ({form})", style="yellow"))

    def print_item(self, item: dict[str, Any]) -> None:
        """A transcript item: a message, or a compaction's divider and its summary."""
        if item.get("kind") != "compaction":
            self.print_message(item)
            return
        how = "automatic" if item.get("auto") else "manual"
        self.out.print(Text(f"── compacted · {how} · {item.get('tokens_before')} → "
                            f"{item.get('tokens_after')} tokens ──", style="dim"))
        self.print_message({"role": "summary", "content": item.get("summary") or ""})

    def print_message(self, message: dict[str, Any]) -> None:
        line = Text(f"{message.get('role', '?')}: ", style="bold")
        line.append(shown(str(message.get("content") or "")))
        if message.get("supersedes"):
            line.append("  (retried: replaces the answer before it)", style="dim")
        self.out.print(line)


def result_text(p: dict[str, Any]) -> str:
    status = p.get("status", "completed")
    if status == "completed":
        return f"compaction completed: {p.get('tokens_before')} → {p.get('tokens_after')} tokens"
    return f"compaction {status}: {p.get('error') or ''}".rstrip(": ")


def lines_from_terminal() -> Iterator[str]:
    from prompt_toolkit import PromptSession

    prompt: PromptSession[str] = PromptSession()
    while True:
        try:
            yield prompt.prompt("you: ")
        except KeyboardInterrupt:
            continue  # Ctrl-C clears the line, as in a shell
        except EOFError:
            return


def lines_from_pipe() -> Iterator[str]:
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")  # a stray byte is not the end of the chat
    for line in sys.stdin:
        yield line.rstrip("\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--session", help="go on with this session (default: a new one)")
    parser.add_argument("--url", default=os.environ.get("GATEWAY_URL", DEFAULT_URL),
                        help=f"the gateway (default: GATEWAY_URL or {DEFAULT_URL})")
    return parser.parse_args(argv)


def auth_headers() -> dict[str, str]:
    """The gateway's token, when it has one. For `auto`, the one `make run`
    made and keeps under DATA_DIR: the same setting that gave the gateway
    its token then gives it to the chat too."""
    token = os.environ.get("GATEWAY_TOKEN", "")
    if token == "auto":
        kept = Path(os.environ.get("DATA_DIR", ROOT / ".data")) / "gateway-token"
        token = kept.read_text().strip() if kept.exists() else ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # No markup: a model name or a server's words in brackets are text, not styles.
    console = Console(highlight=False, soft_wrap=True, markup=False)
    # No proxy from the environment for a gateway on this machine: it would
    # not reach it, and would read every message and the token on the way.
    local = httpx.URL(args.url).host in ("127.0.0.1", "localhost", "::1")
    with httpx.Client(base_url=args.url.rstrip("/"), headers=auth_headers(),
                      timeout=httpx.Timeout(30, read=330), trust_env=not local) as c:
        chat = Chat(c, console)
        try:
            chat.open(args.session)
        except (ChatError, httpx.HTTPError) as err:
            console.print(Text(f"cannot start: {err}", style="bold red"))
            return 1
        lines = lines_from_terminal() if sys.stdin.isatty() else lines_from_pipe()
        for line in lines:
            try:
                if not chat.handle(line):
                    break
            except (ChatError, httpx.HTTPError) as err:
                console.print(Text(f"error: {err}", style="bold red"))
            except KeyboardInterrupt:  # mid-command: back to the prompt, as in a shell
                console.print(Text("\n(interrupted)", style="yellow"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
