"""Every service's Prometheus metrics, scraped after a turn and a compaction:
the counts match what happened, and no label carries a session id."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas import subjects
from tests.events import watching
from tests.nats_server import NatsServer, free_port
from tests.system import System, ask, new_session

SERVICES = ("tools", "generator", "decider", "gateway")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def system(private_nats: NatsServer, stub_url: str) -> Iterator[System]:
    # A NATS of its own: the decider's durable consumer would otherwise
    # also count the reports other tests left in the shared stream.
    running = System(private_nats.url, stub_url, {"COMPACTION_TAIL_TURNS": "1"}, services=SERVICES)
    for name in ("tools", "generator", "decider"):
        running[name].env = {**running[name].env, "METRICS_PORT": str(free_port())}
    try:
        yield running.start()
    finally:
        running.stop()


def metrics_url(system: System, name: str) -> str:
    if name == "gateway":
        return f"{system.base_url}/metrics"
    return f"http://127.0.0.1:{system[name].env['METRICS_PORT']}/metrics"


def scrape(system: System, name: str) -> Samples:
    text = httpx.get(metrics_url(system, name), timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def until_counted(system: System, name: str, metric: str, wanted: float,
                        **labels: str) -> Samples:
    """Scrape until the metric reaches `wanted` (a report is read a moment
    after the reply that caused it)."""
    async with asyncio.timeout(15):
        while True:
            samples = await asyncio.to_thread(scrape, system, name)
            if value(samples, metric, **labels) >= wanted:
                return samples
            await asyncio.sleep(0.05)


async def test_every_service_counts_a_turn_and_a_compaction(
        system: System, private_nats: NatsServer) -> None:
    with system.client() as client:
        sid = new_session(client)
        for n in range(2):
            assert ask(client, sid, f"question {n} " * 20).status_code == 200
        async with watching(private_nats.url, "compaction.result") as results:
            response = client.post(f"/api/sessions/{sid}/compact")
            assert response.status_code == 202, response.text
            result = await results.wait_for(lambda e: e["session_id"] == sid)
        assert result["payload"]["status"] == "completed", result
        # A prompt larger than the window, with nothing to compact: a failed turn.
        full = new_session(client, auto_compact=False)
        assert ask(client, full, "word " * 12_000).status_code == 413

    generator = scrape(system, "generator")
    assert value(generator, "generator_turns_total", outcome="answered", error_code="none") == 2
    assert value(generator, "generator_turns_total", outcome="failed",
                 error_code="context_overflow") == 1
    assert value(generator, "generator_compactions_total", status="completed", level="gentle",
                 trigger="manual") == 1
    assert value(generator, "generator_compaction_tokens_freed_total") > 0
    assert value(generator, "generator_summary_seconds_count") == 1
    assert value(generator, "generator_turn_seconds_count") == 3
    assert value(generator, "generator_queue_wait_seconds_count") == 3
    assert value(generator, "generator_lock_wait_seconds_count") == 3
    assert value(generator, "generator_model_seconds_count", purpose="answer") == 2
    assert value(generator, "generator_model_seconds_count", purpose="summary") == 1
    assert value(generator, "generator_redeliveries_total") == 0
    # Head starts as the generator's status counts them (the second turn has one).
    nc = await nats.connect(private_nats.url)
    try:
        reply = await nc.request(subjects.service_status("generator"), b"", timeout=10)
        status = json.loads(reply.data)
    finally:
        await nc.close()
    for outcome in ("kept", "abandoned"):
        assert value(generator, "generator_head_starts_total",
                     outcome=outcome) == status["head_starts"][outcome]
    assert sum(status["head_starts"].values()) >= 1
    assert value(generator, "generator_stale_writes_rejected_total") == 0

    decider = await until_counted(system, "decider", "decider_generation_reports_total", 2)
    assert value(decider, "decider_generation_reports_total") == 2
    # The first report has no calibration yet; both are compared with the count.
    assert value(decider, "decider_estimate_ratio_count") == 2
    assert value(decider, "decider_provider_prompt_tokens_total") > 0

    gateway = scrape(system, "gateway")
    assert value(gateway, "gateway_http_responses_total", method="POST", status="200") == 2
    assert value(gateway, "gateway_http_responses_total", method="POST", status="202") == 1

    for name in SERVICES:
        samples = generator if name == "generator" else scrape(system, name)
        label = "compaction-decider" if name == "decider" else name
        assert value(samples, "nats_connected", service=label) == 1, name
        assert all(sid not in v for (_, labels) in samples for _, v in labels), name
