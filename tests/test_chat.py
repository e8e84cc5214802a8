"""`python -m scripts.chat` against the whole system, fed from a pipe: a new
session, streamed answers with a context line, /compact, /state,
/transcript, and going on with a session by its id."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import nats
import pytest

from schemas.subjects import QUERIES_STREAM
from scripts.chat import UNKNOWN_OUTCOME, auth_headers, failure
from tests.events import until
from tests.nats_server import NatsServer
from tests.ports import free_port
from tests.processes import REPO_ROOT
from tests.stub_server import configure_stub_now, running_stub
from tests.system import System, new_session, running_system


@pytest.fixture(scope="module")
def system(nats_url: str, stub_url: str) -> Iterator[System]:
    with running_system(nats_url, stub_url, {"COMPACTION_TAIL_TURNS": "1"}) as running:
        yield running


def chat(system: System, lines: list[str], *args: str,
         env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "scripts.chat", "--url", system.base_url, *args],
        input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=REPO_ROOT,
        timeout=90, check=False, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_what_the_model_says_is_shown_not_obeyed_and_no_proxy_sees_it(system: System) -> None:
    """The answer echoes escape sequences (clear the screen, write the
    clipboard): they reached the terminal. A proxy set in the environment got
    every request, token included, and a stray byte in piped input ended the
    chat with a traceback."""
    dead = f"http://127.0.0.1:{free_port()}"
    out = chat(system, ["look \x1b]52;c;aGk=\x07 and \x1b[2J here"],
               env={"HTTP_PROXY": dead, "HTTPS_PROXY": dead, "ALL_PROXY": dead})
    assert "assistant: Echo: look " in out
    assert "\x1b" not in out and "\x07" not in out
    assert "\u241b]52;c;aGk=\u2407 and \u241b[2J here" in out
    done = subprocess.run([sys.executable, "-m", "scripts.chat", "--url", system.base_url],
                          input=b"caf\xe9 au lait\n", capture_output=True, cwd=REPO_ROOT,
                          timeout=90, check=False)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    assert "Echo: caf\ufffd au lait".encode() in done.stdout


def test_brackets_from_the_server_are_text_not_styles(system: System) -> None:
    """A model name `[/]` read as a closing style tag ended the chat with a
    traceback at /state; /help lost its `[instructions]`."""
    with system.client() as http:
        sid = new_session(http, model="[/]")
    out = chat(system, ["/state", "/help"], "--session", sid)
    assert "model [/]" in out and "[instructions]" in out


def test_a_conversation_with_a_compaction(system: System) -> None:
    long = "the quick brown fox jumps over the lazy dog " * 15
    out = chat(system, [f"hello there {long}", f"and again {long}",
                        "/compact keep the greetings", "/state",
                        "/transcript", "/nonsense", "//usr/bin/env is a path", "/quit",
                        "never sent"])
    assert "session " in out
    assert "assistant: Echo: hello there the quick" in out
    assert "assistant: Echo: and again the quick" in out
    assert out.count("context: ") >= 3  # after each answer, the compaction and /state
    assert "compacting…" in out
    assert "compaction completed: " in out
    assert "state idle" in out
    assert "summary: " in out and "compacted · manual" in out  # the transcript's divider
    assert "unknown command /nonsense" in out
    assert "assistant: Echo: /usr/bin/env is a path" in out  # sent as //usr/bin/env
    assert "never sent" not in out


def test_retry_answers_the_last_message_afresh_and_the_transcript_says_which_replaced(
        system: System) -> None:
    out = chat(system, ["/retry", "hello", "/retry", "/transcript"])
    assert "error: nothing_to_retry" in out  # nothing asked yet
    transcript = out.split("user: hello", 1)[1]
    first, retried = transcript.splitlines()[1:3]
    assert first == "assistant: Echo: hello (turn 1)"
    assert retried == "assistant: Echo: hello (turn 1)  (retried: replaces the answer before it)"
    assert out.count("context: ") >= 2  # after each answer


def test_export_writes_the_whole_transcript_to_a_file(system: System, tmp_path: Path) -> None:
    markdown, raw = tmp_path / "chat.md", tmp_path / "chat.json"
    out = chat(system, ["first words", f"/export {markdown}", f"/export {raw}"])
    assert f"transcript written to {markdown} (markdown)" in out
    assert "first words" in markdown.read_text() and "Echo: first words" in markdown.read_text()
    items = json.loads(raw.read_text())
    assert "Echo: first words (turn 1)" in json.dumps(items)


def test_a_refused_compaction_is_said_and_the_chat_goes_on(system: System) -> None:
    out = chat(system, ["first", "/compact " + "x" * 4001, "second"])
    assert "compaction requested" not in out and "compacting…" not in out
    assert "error: invalid_field: instructions: String should have at most 4000" in out
    assert "Echo: second (turn 2)" in out


def test_an_existing_session_goes_on_and_an_unknown_one_is_refused(system: System) -> None:
    first = chat(system, ["one"])
    sid = first.split("session ", 1)[1].split()[0]
    again = chat(system, ["two"], "--session", sid)
    assert "Echo: two (turn 2)" in again
    done = subprocess.run([sys.executable, "-m", "scripts.chat", "--url", system.base_url,
                           "--session", "nosuchsession"], input="", capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=60, check=False)
    assert done.returncode == 1
    assert "unknown_session" in done.stdout or "not_found" in done.stdout


def test_again_sends_a_late_message_once_more_and_it_is_answered_once(
        private_nats: NatsServer) -> None:
    # The model held until the gateway has given up on the answer (REPLY_TIMEOUT_S 1 s):
    # the client cannot know the message was taken, and says /again will send it. NATS
    # of its own: another module's generator must not take the query to a model not held.
    with running_stub() as stub, \
            running_system(private_nats.url, stub, {"REPLY_TIMEOUT_S": "1"},
                           services=("generator", "gateway")) as system:
        configure_stub_now(stub, held_models=["stub-model"])
        client, printed = chat_client(system)
        assert client.stdin is not None
        client.stdin.write("hello\n")
        client.stdin.flush()
        sid = printed.next_with("session ").split("session ", 1)[1].split()[0]
        assert "reply_timeout" in printed.next_with("/again")
        configure_stub_now(stub, held_models=[])
        with system.client() as http:
            until(lambda: len(http.get(f"/api/sessions/{sid}").json()["messages"]) == 2,
                  "the late answer stored")
            client.stdin.write("/again\n")
            client.stdin.close()
            client.wait(timeout=60)
            out = printed.rest()
            stored = http.get(f"/api/sessions/{sid}").json()["messages"]
    assert "assistant: Echo: hello (turn 1)" in out, out
    assert [m["role"] for m in stored] == ["user", "assistant"]


def chat_client(system: System, *args: str) -> tuple[subprocess.Popen[str], Printed]:
    """The client, fed line by line, and what it prints as it prints it."""
    client = subprocess.Popen(
        [sys.executable, "-m", "scripts.chat", "--url", system.base_url, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert client.stdout is not None
    return client, Printed(client.stdout)


class Printed:
    """The lines a child prints, as they come, read by a thread of their own."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)

    def next_with(self, text: str) -> str:
        seen = []
        while True:  # bounded only against a client gone wrong: it prints what it does
            try:
                line = self._lines.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"never printed {text!r}; printed {seen}") from None
            if text in line:
                return line
            seen.append(line)

    def rest(self) -> str:
        """All printed since, once the child has closed its output."""
        self._reader.join(timeout=60)
        return "".join(self._lines.get_nowait() for _ in range(self._lines.qsize()))


@pytest.mark.parametrize("retried", [False, True], ids=["message", "retry"])
def test_ctrl_c_while_it_answers_stops_that_answer_and_the_chat_goes_on(
        private_nats: NatsServer, retried: bool) -> None:
    with running_stub() as stub, \
            running_system(private_nats.url, stub, {}, services=("generator", "gateway")) \
            as system:
        client, printed = chat_client(system)
        assert client.stdin is not None
        try:
            sid = printed.next_with("session ").split("session ", 1)[1].split()[0]
            if retried:  # a message answered, whose answer is then asked for afresh
                client.stdin.write("tell me a long story\n")
                client.stdin.flush()
                printed.next_with("assistant: Echo: tell me a long story")
            configure_stub_now(stub, paused_models=["stub-model"])  # first piece, then waits
            client.stdin.write("/retry\n" if retried else "tell me a long story\n")
            client.stdin.flush()
            with system.client() as http:
                until(lambda: http.get(f"/api/sessions/{sid}").json()["phase"] == "generating",
                      "the answer under way")
                client.send_signal(signal.SIGINT)  # what Ctrl-C does in a terminal
                assert "stopping" in printed.next_with("/again")
            configure_stub_now(stub, paused_models=[])
            ended(client, "and now briefly\n/quit\n")
            out = printed.rest()
        finally:
            if client.poll() is None:
                client.kill()
    assert "assistant: Echo: and now briefly (turn 2)" in out, out


def test_ctrl_c_while_its_message_waits_for_its_turn_withdraws_it(
        private_nats: NatsServer) -> None:
    """Another client's answer of the session runs: the message is withdrawn,
    not answered after it."""
    with running_stub() as stub, \
            running_system(private_nats.url, stub, {}, services=("generator", "gateway")) \
            as system, system.client(timeout_s=60) as http:
        sid = new_session(http)
        configure_stub_now(stub, held_models=["stub-model"])  # answers once let go
        ahead = threading.Thread(target=lambda: ask(system, sid, "from another client"))
        ahead.start()
        until(lambda: http.get(f"/api/sessions/{sid}").json()["phase"] == "generating",
              "the other answer under way")
        client, printed = chat_client(system, "--session", sid)
        assert client.stdin is not None
        try:
            client.stdin.write("never mind\n")
            client.stdin.flush()
            until(lambda: queued_here(private_nats.url) == 2, "the message queued")
            client.send_signal(signal.SIGINT)  # what Ctrl-C does in a terminal
            assert "withdrawn before its turn" in printed.next_with("withdrawn")
            configure_stub_now(stub, held_models=[])
            ended(client, "/quit\n")
        finally:
            if client.poll() is None:
                client.kill()
            configure_stub_now(stub, held_models=[])
            ahead.join(timeout=60)
        users = [m["content"] for m in http.get(f"/api/sessions/{sid}").json()["messages"]
                 if m["role"] == "user"]
    assert users == ["from another client"]


def ended(client: subprocess.Popen[str], last_lines: str) -> None:
    """The client given its last lines, and gone with no error."""
    assert client.stdin is not None
    client.stdin.write(last_lines)
    client.stdin.close()
    assert client.wait(timeout=60) == 0


def ask(system: System, sid: str, content: str) -> None:
    with system.client(timeout_s=60) as http:
        http.post(f"/api/sessions/{sid}/messages", json={"content": content})


def queued_here(nats_url: str) -> int:
    """The queries in the QUERIES stream of the test's own server."""
    async def count() -> int:
        nc = await nats.connect(nats_url)
        try:
            return int((await nc.jetstream().stream_info(QUERIES_STREAM)).state.messages)
        finally:
            await nc.close()
    return asyncio.run(count())


def test_the_terminal_chat_and_the_page_send_again_after_the_same_failures() -> None:
    page = (REPO_ROOT / "services/gateway/static/answer.js").read_text()
    listed = re.search(r"const UNKNOWN_OUTCOME = \[(.*?)\];", page, re.S)
    assert listed is not None
    assert set(re.findall(r'"([a-z_0-9]+)"', listed.group(1))) == set(UNKNOWN_OUTCOME)
    # Without the gateway's JSON (a proxy's answer), a failure is named by its status.
    proxied = httpx.Response(503, text="<html>Service Unavailable</html>")
    assert failure(proxied).code == "http_503"


def test_an_auto_token_is_the_one_make_run_keeps(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With GATEWAY_TOKEN=auto, as `make run` was started, the chat sent no
    token and every request was refused."""
    (tmp_path / "gateway-token").write_text("kept-token\n")
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    monkeypatch.setenv("GATEWAY_TOKEN", "auto")
    assert auth_headers() == {"Authorization": "Bearer kept-token"}
    monkeypatch.setenv("GATEWAY_TOKEN", "given")
    assert auth_headers() == {"Authorization": "Bearer given"}
    monkeypatch.setenv("GATEWAY_TOKEN", "")
    assert auth_headers() == {}
