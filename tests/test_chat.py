"""`python -m scripts.chat` against the whole system, fed from a pipe: a new
session, streamed answers with a context line, /compact, /state,
/transcript, and going on with a session by its id."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.processes import REPO_ROOT
from tests.system import System, running_system


@pytest.fixture(scope="module")
def system(nats_url: str, stub_url: str) -> Iterator[System]:
    with running_system(nats_url, stub_url, {"COMPACTION_TAIL_TURNS": "1"}) as running:
        yield running


def chat(system: System, lines: list[str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "scripts.chat", "--url", system.base_url, *args],
        input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=REPO_ROOT,
        timeout=90, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_conversation_with_a_compaction(system: System) -> None:
    long = "the quick brown fox jumps over the lazy dog " * 15
    out = chat(system, [f"hello there {long}", f"and again {long}",
                        "/compact keep the greetings", "/state",
                        "/transcript", "/nonsense", "/quit", "never sent"])
    assert "session " in out
    assert "assistant: Echo: hello there the quick" in out
    assert "assistant: Echo: and again the quick" in out
    assert out.count("context: ") >= 3  # after each answer, the compaction and /state
    assert "compacting…" in out
    assert "compaction completed: " in out
    assert "state idle" in out
    assert "summary: " in out and "compacted · manual" in out  # the transcript's divider
    assert "unknown command /nonsense" in out
    assert "never sent" not in out


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
