"""The message contract: envelopes, payloads, subjects, exported JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import CompactionRequest, CompactionResult, GenerationReport
from scripts.export_schemas import rendered, stale_files, write
from services.shared.bus import BadMessage, decode


def generation(**overrides: object) -> dict[str, object]:
    payload = {"session_id": "s1", "model": "m", "prompt_tokens": 10, "completion_tokens": 2,
               "sent_chars": 40, "num_ctx": 2048}
    return {"message_type": "response.generation", "subject": subjects.RESPONSE_GENERATION,
            "sender_id": "generator", "session_id": "s1", "payload": {**payload, **overrides}}


def test_envelope_carries_every_pinned_field() -> None:
    env = Envelope[GenerationReport].model_validate(generation())
    dumped = json.loads(env.model_dump_json())
    assert set(dumped) >= {"message_id", "message_type", "subject", "sender_id",
                           "correlation_id", "session_id", "timestamp", "schema_version",
                           "payload"}
    assert set(dumped["payload"]) >= {"session_id", "model", "prompt_tokens",
                                      "completion_tokens", "sent_chars", "num_ctx"}


def test_provider_count_may_be_null() -> None:
    env = Envelope[GenerationReport].model_validate(generation(prompt_tokens=None))
    assert env.payload.prompt_tokens is None


@pytest.mark.parametrize("model, payload", [
    (CompactionRequest, {"session_id": "s1", "auto": True, "reason": "r"}),
    (CompactionResult, {"session_id": "s1", "tokens_before": 10, "tokens_after": 5,
                        "summary": "x", "error": None}),
])
def test_pinned_payloads_validate(model: type, payload: dict[str, object]) -> None:
    assert model.model_validate(payload)


def test_unknown_fields_are_refused_everywhere() -> None:
    with pytest.raises(ValidationError):
        Envelope[GenerationReport].model_validate({**generation(), "surprise": 1})
    with pytest.raises(ValidationError):
        Envelope[GenerationReport].model_validate(generation(surprise=1))


def test_decode_names_the_bad_fields() -> None:
    with pytest.raises(BadMessage) as caught:
        decode(json.dumps(generation(sent_chars="many")).encode(), GenerationReport,
               subjects.RESPONSE_GENERATION)
    report = caught.value.report
    assert report.code == "invalid_message"
    assert report.subject == subjects.RESPONSE_GENERATION
    assert [d["field"] for d in report.details] == ["payload.sent_chars"]
    with pytest.raises(BadMessage):
        decode(b"\xff not json", GenerationReport, "x")


@pytest.mark.parametrize("bad", ["", "a.b", "a*", ">", "a b", "a\tb", "x" * 65, "ü"])
def test_session_ids_that_could_cross_subjects_are_refused(bad: str) -> None:
    with pytest.raises(subjects.InvalidSubjectToken):
        subjects.query(bad)
    with pytest.raises(ValidationError):
        CompactionRequest(session_id=bad, auto=False)


def test_contract_subject_names_are_pinned() -> None:
    assert subjects.RESPONSE_GENERATION == "response.generation"
    assert subjects.COMPACTION_REQUEST == "compaction.request"
    assert subjects.COMPACTION_RESULT == "compaction.result"
    assert subjects.query("abc") == "chat.query.abc"


def test_exported_json_schemas_are_current() -> None:
    assert stale_files() == [], "run: python scripts/export_schemas.py"


def test_stale_schema_files_are_detected(tmp_path: Path) -> None:
    write(tmp_path)
    assert stale_files(tmp_path) == []
    (tmp_path / "compaction.request.json").write_text("{}")
    (tmp_path / "left-over.json").write_text("{}")
    assert stale_files(tmp_path) == ["compaction.request.json", "left-over.json"]
    assert "response.generation.json" in rendered()
