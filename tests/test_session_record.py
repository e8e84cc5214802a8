"""Session records stored by an earlier version still load.

`SessionRecord.compactions` was retired (the history's snapshot counts a
session's compactions); records in the `sessions` bucket that still carry it
are read without it and written back without it. Real processes, a real
nats-server, the stand-in."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import nats
import pytest
from pydantic import ValidationError

from schemas.session import SessionRecord
from services.shared.jetstream import sessions_bucket
from tests.events import eventually
from tests.system import System, ask, running_system

OLD_RECORD = {
    "session_id": "old-format", "system": "You are terse.", "model": None,
    "auto_compact": True, "created_at": "2026-01-02T03:04:05Z",
    "tokens_per_char": None, "compactions": 2, "context_length": None,
}


def test_a_record_with_the_retired_field_loads_and_is_dumped_without_it() -> None:
    record = SessionRecord.model_validate_json(json.dumps(OLD_RECORD))
    assert record.session_id == "old-format" and record.system == "You are terse."
    assert "compactions" not in json.loads(record.model_dump_json())


def test_any_other_unknown_field_is_still_refused() -> None:
    with pytest.raises(ValidationError):
        SessionRecord.model_validate({**OLD_RECORD, "compacted": 2})


@pytest.fixture(scope="module")
def system(nats_url: str, stub_url: str) -> Iterator[System]:
    with running_system(nats_url, stub_url, services=("generator", "gateway")) as running:
        yield running


async def stored(nats_url: str, sid: str) -> dict[str, Any]:
    nc = await nats.connect(nats_url)
    try:
        entry = await (await sessions_bucket(nc.jetstream())).get(sid)
        assert entry.value is not None
        return dict(json.loads(entry.value))
    finally:
        await nc.close()


async def test_a_stored_old_record_is_served_answered_and_written_back_without_the_field(
        system: System, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        kv = await sessions_bucket(nc.jetstream())
        await kv.put(OLD_RECORD["session_id"], json.dumps(OLD_RECORD).encode())
    finally:
        await nc.close()
    sid = str(OLD_RECORD["session_id"])
    with system.client() as client:
        session = client.get(f"/api/sessions/{sid}")
        assert session.status_code == 200, session.text
        answer = ask(client, sid, "hello there")
        assert answer.status_code == 200, answer.text
        assert answer.json()["reply"] == "Echo: hello there (turn 1)"

    async def calibrated() -> bool:
        return (await stored(nats_url, sid))["tokens_per_char"] is not None

    # The generator writes the record back with its first calibration.
    await eventually(calibrated, "the record written back with a calibration")
    assert "compactions" not in await stored(nats_url, sid)
