"""Dense scripts on real processes: once the model server has counted prompts
of prose and then one with Chinese in it, the generator's record of the
session and its `response.generation` report carry a rate of their own for
dense text, and that rate reproduces the server's count of Chinese.

The Chinese comes after some prose turns, as in a conversation: a count of a
prompt whose new part is most of it could be of that part alone (a prompt
cache), and such a count teaches no rate."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from schemas import subjects
from schemas.session import CountBasis
from scripts.ollama_stub.tokens import count_text_tokens
from services.core.text_size import extra_bytes
from services.core.tokens import calibration_from, estimate_tokens
from tests.events import watching
from tests.stub_server import running_stub
from tests.system import System, running_system

PROSE = "The quick brown fox jumps over the lazy dog near the river bank. " * 40
CHINESE = "我们今天讨论一下这个项目的进度和下一步的计划。" * 22
CHARS_PER_TOKEN = 4.0  # the stand-in's default


@pytest.fixture(scope="module")
def system(nats_url: str) -> Iterator[System]:
    with running_stub() as stub, running_system(nats_url, stub,
                                                services=("generator", "gateway")) as running:
        yield running


async def reports_of(system: System, nats_url: str, turns: Sequence[str]
                     ) -> list[dict[str, Any]]:
    """The `response.generation` payloads of a new session's turns, in order."""
    async with system.http(timeout=30) as http, \
            watching(nats_url, subjects.RESPONSE_GENERATION) as reports:
        sid = str((await http.post("/api/sessions", json={})).json()["session_id"])

        def of_session() -> list[dict[str, Any]]:
            return [p for p in reports.payloads() if p["session_id"] == sid]

        for content in turns:
            assert (await http.post(f"/api/sessions/{sid}/messages",
                                    json={"content": content})).status_code == 200
        await reports.wait_until(lambda: len(of_session()) == len(turns))
    return of_session()


async def test_a_prompt_with_chinese_after_one_of_prose_teaches_the_dense_rate(
        system: System, nats_url: str) -> None:
    *prose, chinese = await reports_of(system, nats_url, (PROSE, PROSE, PROSE, CHINESE))
    assert {p["tokens_per_extra_byte"] for p in prose} == {None}  # nothing dense counted yet
    per_char, per_byte = chinese["tokens_per_char"], chinese["tokens_per_extra_byte"]
    assert isinstance(per_char, float) and isinstance(per_byte, float)
    learnt = calibration_from(per_char, per_byte, None)
    estimate = estimate_tokens(len(CHINESE), learnt, extra_bytes=extra_bytes(CHINESE))
    true = count_text_tokens(CHINESE, CHARS_PER_TOKEN)
    assert estimate == pytest.approx(true, rel=0.05)


async def test_a_conversation_in_chinese_is_estimated_from_its_first_count(
        system: System, nats_url: str) -> None:
    """Every message in Chinese: no two counts differ enough in make-up to
    tell the two rates apart, yet the third prompt, estimated from what the
    reports carry (as the decider does), is within 5 % of the stand-in's
    count, where a cautious rate on top of the first count put it 43 % above."""
    _, second, third = await reports_of(system, nats_url, (CHINESE,) * 3)
    assert second["tokens_per_extra_byte"] is None and second["count_basis"] is not None
    basis = CountBasis.model_validate(second["count_basis"])
    calibration = calibration_from(second["tokens_per_char"], None, basis)
    estimate = estimate_tokens(third["sent_chars"], calibration, third["sent_messages"],
                               third["sent_extra_bytes"])
    assert estimate == pytest.approx(third["prompt_tokens"], rel=0.05)
