"""`python -m scripts.watch`: one readable line per message, filtered by
session and subject, raw with --json; run as a process against real NATS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from schemas import subjects
from scripts.watch import credentials, describe, session_of
from services.shared.settings import ServiceSettings
from tests.nats_server import NatsServer, running_shipped_nats
from tests.processes import REPO_ROOT


def envelope(subject: str, message_type: str, sid: str, **payload: object) -> bytes:
    return json.dumps({
        "message_id": "m1", "message_type": message_type, "subject": subject,
        "sender_id": "generator", "correlation_id": "c1", "session_id": sid,
        "timestamp": "2026-01-02T03:04:05.678901+00:00", "schema_version": 1,
        "payload": {"session_id": sid, **payload},
    }).encode()


STATE = envelope("generator.state.abcdef123456", "generator.state", "abcdef123456",
                 from_state="idle", to_state="receiving", action="receive", generator_id="g")
RESULT = envelope("compaction.result", "compaction.result", "abcdef123456",
                  status="completed", tokens_before=900, tokens_after=300, level="gentle")
GENERATION = envelope("response.generation", "response.generation", "abcdef123456",
                      model="m", prompt_tokens=120, completion_tokens=30, sent_chars=480,
                      num_ctx=2048, duration_ms=12.5)


@pytest.mark.parametrize("subject, data, wanted", [
    ("generator.state.abcdef123456", STATE, "idle → receiving"),
    ("compaction.result", RESULT, "completed gentle manual, 900 → 300 tokens"),
    ("response.generation", GENERATION, "prompt 120 · completion 30 tokens · 480 chars"),
])
def test_each_kind_of_message_shows_its_key_fields(subject: str, data: bytes,
                                                   wanted: str) -> None:
    line = describe(subject, data)
    assert wanted in line.detail
    assert (line.time, line.sender, line.session) == ("03:04:05.678", "generator", "abcdef12")


def covered(subject: str, pattern: str) -> bool:
    """NATS matching: `*` one token, `>` the rest (one token at least)."""
    tokens, wanted = subject.split("."), pattern.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or token not in ("*", tokens[i]):
            return False
    return len(tokens) == len(wanted)


def test_the_watched_subjects_cover_every_subject_the_services_talk_on() -> None:
    spoken = [subjects.RESPONSE_GENERATION, subjects.COMPACTION_REQUEST,
              subjects.COMPACTION_RESULT, subjects.COMPACTION_EVENT, subjects.query("s"),
              subjects.reply("s"), subjects.token("s"), subjects.stop("s"),
              subjects.state("s"), subjects.tool("word_count"), subjects.TOOL_LIST,
              subjects.ERROR_SUBJECT]
    missed = [s for s in spoken if not any(covered(s, p) for p in subjects.SYSTEM_SUBJECTS)]
    assert not missed
    # The history stream's own writes are state, not talk: left out.
    assert not any(covered(subjects.history("s"), p) for p in subjects.SYSTEM_SUBJECTS)


def test_what_is_not_an_envelope_is_shown_raw() -> None:
    assert describe("tool.list", b"[1, 2]").detail == "[1, 2]"
    assert describe("x", b"\xff{").detail  # never raises
    # Shown, not obeyed: an escape sequence would retitle the watcher's window.
    assert describe("x", b"\x1b]0;pwned\x07").text().plain.endswith("\u241b]0;pwned\u2407")


def test_an_envelopes_own_fields_are_shown_not_obeyed() -> None:
    """Only the detail was made safe: a sender id carrying an escape sequence
    cleared the screen, and a session id of another type or JSON nested too
    deep dropped the line."""
    hostile = json.dumps({"sender_id": "\x1b[2J\x1b]0;pwned\x07", "session_id": 12345,
                          "timestamp": "\x1b]0;when\x07",
                          "message_type": "chat.query", "payload": {"content": "hi"}})
    text = describe("chat.query.\x1b[2J", hostile.encode()).text().plain
    assert "\x1b" not in text and "\x07" not in text
    assert "12345" in text
    nested = b'{"payload": ' * 5000 + b"{}" + b"}" * 5000
    assert describe("x", nested).detail  # never raises
    assert session_of(nested) is None


def test_a_number_too_big_for_a_float_is_an_unreadable_payload() -> None:
    """JSON reads 1e400 as infinity, which `round` cannot make an int of: the
    OverflowError escaped and the message's line was never printed."""
    line = describe("response.generation", GENERATION.replace(b"12.5", b"1e400"))
    assert line.detail.startswith("(unreadable payload")
    assert line.session == "abcdef12"


@pytest.mark.parametrize("url", [
    "nats://admin:right@127.0.0.1:4222", "nats://a-token@127.0.0.1:4222",
    "nats://127.0.0.1:4222, nats://admin:right@127.0.0.1:4223", "admin:right@127.0.0.1:4222",
])
def test_credentials_in_nats_url_are_credentials_given(tmp_path: Path, url: str) -> None:
    """nats-py puts options given before the URL's own user and password: the
    kept admin password must not be given when the URL carries credentials."""
    kept = tmp_path / "nats-passwords.env"
    kept.write_text("NATS_ADMIN_PASSWORD=stale\n")
    assert credentials(ServiceSettings(nats_url=url), kept) == {}
    assert credentials(ServiceSettings(nats_url="nats://127.0.0.1:4222"), kept) == {
        "user": "admin", "password": "stale"}


@asynccontextmanager
async def watcher(nats_url: str, *args: str, data_dir: Path | None = None,
                  stderr: int = asyncio.subprocess.STDOUT,
                  stdout: int = asyncio.subprocess.PIPE,
                  ) -> AsyncIterator[asyncio.subprocess.Process]:
    env = {**os.environ, "NATS_URL": nats_url, "PYTHONUNBUFFERED": "1",
           **({"DATA_DIR": str(data_dir)} if data_dir else {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scripts.watch", *args, cwd=REPO_ROOT, env=env,
        stdout=stdout, stderr=stderr)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def line_with(proc: asyncio.subprocess.Process, text: str) -> list[str]:
    """Lines printed until one containing `text` (that one last)."""
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(20):
            while not lines or text not in lines[-1]:
                lines.append((await proc.stdout.readline()).decode())
                assert lines[-1], f"the watcher exited: {lines}"
    except TimeoutError:
        raise AssertionError(f"no line with {text!r} in 20 s; printed: {lines}") from None
    return lines


async def test_it_prints_one_line_per_message_of_the_session_asked_for(
        nats_url: str, nc: NATS) -> None:
    async with watcher(nats_url, "--session", "abcdef") as proc:
        await line_with(proc, "watching")
        await nc.publish("generator.state.other", envelope(
            "generator.state.other", "generator.state", "other", from_state="idle",
            to_state="receiving", action="receive", generator_id="g"))
        await nc.publish("generator.state.abcdef123456", STATE)
        await nc.publish("compaction.result", RESULT)
        lines = await line_with(proc, "900 → 300")
    assert "idle → receiving" in lines[0] and "abcdef12" in lines[0]
    assert not any("other" in line for line in lines)
    assert len(lines) == 2


async def test_json_prints_the_raw_envelope_of_the_subjects_asked_for(
        nats_url: str, nc: NATS) -> None:
    async with watcher(nats_url, "--json", "--subject", "compaction.>") as proc:
        await line_with(proc, "watching")
        await nc.publish("response.generation", GENERATION)  # not asked for
        await nc.publish("compaction.result", RESULT)
        lines = await line_with(proc, "compaction.result")
    assert len(lines) == 1
    assert json.loads(lines[0])["payload"]["tokens_after"] == 300


async def test_json_output_stays_envelopes_while_nats_restarts(
        private_nats: NatsServer) -> None:
    """What the watcher says of its connection goes to stderr: `--json`
    output piped into another program is one envelope per line, always."""
    async with watcher(private_nats.url, "--json", "--subject", "compaction.>",
                       stderr=asyncio.subprocess.PIPE) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        await asyncio.wait_for(proc.stderr.readline(), 20)  # "watching ...": subscribed
        private_nats.restart()
        nc = await nats.connect(private_nats.url)
        try:
            # Published until the watcher, reconnected, hears one.
            async with asyncio.timeout(30):
                while True:
                    await nc.publish("compaction.result", RESULT)
                    with contextlib.suppress(TimeoutError):
                        line = await asyncio.wait_for(proc.stdout.readline(), 0.5)
                        break
        finally:
            await nc.close()
    assert json.loads(line)["payload"]["tokens_after"] == 300, line


async def test_without_credentials_it_watches_make_runs_server_as_its_admin(
        tmp_path: Path) -> None:
    with running_shipped_nats(tmp_path) as shipped:  # passwords where make run keeps them
        admin = await nats.connect(shipped.url_for("admin"))
        try:
            async with watcher(f"nats://127.0.0.1:{shipped.server.port}",
                               data_dir=tmp_path) as proc:
                await line_with(proc, "watching")
                await admin.publish("compaction.result", RESULT)
                assert "900 → 300" in (await line_with(proc, "900 → 300"))[-1]
        finally:
            await admin.close()


async def test_credentials_in_nats_url_win_over_a_kept_admin_password(
        tmp_path: Path) -> None:
    """With a passwords file of `make run`'s, a stale one, the watcher sent its
    admin password instead of the right one in NATS_URL, refused forever."""
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "nats-passwords.env").write_text("NATS_ADMIN_PASSWORD=stale\n")
    with running_shipped_nats(tmp_path) as shipped:
        admin = await nats.connect(shipped.url_for("admin"))
        try:
            async with watcher(shipped.url_for("admin"), data_dir=stale) as proc:
                await line_with(proc, "watching")
                await admin.publish("compaction.result", RESULT)
                assert "900 → 300" in (await line_with(proc, "900 → 300"))[-1]
        finally:
            await admin.close()


@pytest.mark.parametrize("args", [["--json"], []], ids=["json", "lines"])
async def test_it_exits_quietly_once_the_reader_of_its_output_is_gone(
        nats_url: str, nc: NATS, args: list[str]) -> None:
    """`watch | head -2`: once head has gone, the next line met a closed pipe,
    logged (--json, running on) or ended in a traceback and status 1."""
    read_end, write_end = os.pipe()
    async with watcher(nats_url, *args, "--subject", "compaction.>", stdout=write_end,
                       stderr=asyncio.subprocess.PIPE) as proc:
        os.close(write_end)
        os.close(read_end)  # the reader gone before the first line
        assert proc.stderr is not None
        assert b"watching" in await asyncio.wait_for(proc.stderr.readline(), 20)
        await nc.publish("compaction.result", RESULT)
        try:
            status = await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            raise AssertionError("the watcher ran on with nowhere to write") from None
        said = (await proc.stderr.read()).decode()
    assert status == 0, said
    assert "Traceback" not in said and "nats_error" not in said, said
