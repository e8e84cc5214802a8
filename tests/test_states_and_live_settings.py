"""The generator's state publisher and live settings, on real NATS."""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats
import pytest
import structlog
from nats.aio.client import Client as NATS

from schemas import subjects
from services.compaction_decider.settings import DeciderSettings
from services.core.state_machine import Action, CompactionMode, IllegalTransition
from services.gateway.settings import GatewaySettings
from services.generator.settings import GeneratorSettings
from services.generator.states import RecordNotTaken, SessionStates
from services.shared.bus import Bus
from services.shared.jetstream import config_bucket, ensure_layout
from services.shared.live_config import LiveSettings
from tests.nats_server import NatsServer
from tests.processes import ServiceProcess
from tests.system import running_system


async def test_an_illegal_transition_is_raised_and_reported(nc: NATS) -> None:
    errors = await nc.subscribe(subjects.ERROR_SUBJECT)
    states = await nc.subscribe(subjects.state("s-illegal"))
    machine = SessionStates(Bus(nc, "generator"), "gen-test", CompactionMode.background)
    await machine.apply("s-illegal", Action.receive)
    with pytest.raises(IllegalTransition):
        await machine.apply("s-illegal", Action.publish)
    report = json.loads((await errors.next_msg(timeout=2)).data)["payload"]
    assert report["code"] == "illegal_transition"
    assert report["subject"] == subjects.state("s-illegal")
    change = json.loads((await states.next_msg(timeout=2)).data)["payload"]
    assert (change["from_state"], change["to_state"], change["generator_id"]) == (
        "idle", "receiving", "gen-test")
    await machine.recover("s-illegal")
    assert machine.current("s-illegal").visible.value == "idle"


async def test_the_compactions_running_here_are_recorded_again_in_a_bucket_made_anew(
        private_nats: NatsServer) -> None:
    """The bucket lives in memory: NATS back after a restart holds it empty."""
    nc = await nats.connect(private_nats.url)
    try:
        js = nc.jetstream()
        await ensure_layout(js)
        machine = SessionStates(Bus(nc, "generator"), "gen-test", CompactionMode.background)
        await machine.compaction_started("s1", "c1")
        await machine.compaction_started("s2", "c2")
        await machine.compaction_ended("s2", "c2")
        await js.delete_key_value(subjects.COMPACTIONS_RUNNING_BUCKET)
        with pytest.raises(RecordNotTaken):  # no bucket yet: the reconnect tries again
            await machine.record_running_again()
        await ensure_layout(js)
        await machine.record_running_again()
        assert await machine.compaction_recorded("s1", "c1")
        assert not await machine.compaction_recorded("s2", "c2")
        await machine.compaction_ended("s1", "c1")
        await machine.record_running_again()
        assert not await machine.compaction_recorded("s1", "c1")
    finally:
        await nc.close()


async def settled(live: LiveSettings[DeciderSettings], changed: asyncio.Event,
                  threshold: float, timeout_s: float = 5.0) -> None:
    """Until `live` holds `threshold`; `changed` is set on each change. The
    timeout is a guard against hanging, not a measure."""
    async with asyncio.timeout(timeout_s):
        while live.current.compaction_threshold != threshold:
            changed.clear()
            await changed.wait()


async def test_settings_change_without_a_restart(nc: NATS) -> None:
    changed = asyncio.Event()
    live = LiveSettings(nc.jetstream(), DeciderSettings(compaction_threshold=0.8),
                        on_change=lambda _: changed.set())
    await live.start()
    kv = await nc.jetstream().key_value(subjects.CONFIG_BUCKET)
    try:
        await kv.put("compaction_threshold", b"0.5")
        await kv.put("compaction_cooldown_s", b"not a number")  # rejected, logged, ignored
        await kv.put("gateway_port", b"1")  # another service's setting
        await settled(live, changed, 0.5)
        assert live.current.compaction_cooldown_s == 30.0
        await kv.put("compaction_threshold", b"0")
        await settled(live, changed, 0)
        # A value refused counts as none, as for a service started now: a
        # running one kept the last good value where a new one took its
        # start-up value, and the two disagreed on the threshold in force.
        await kv.put("compaction_threshold", b"0,6")
        await settled(live, changed, 0.8)
    finally:  # the bucket is the shared server's: later services would read these
        await live.stop()
        for key in ("compaction_threshold", "compaction_cooldown_s", "gateway_port"):
            await kv.delete(key)


async def test_a_setting_the_bucket_no_longer_holds_goes_back_to_its_start(
        private_nats: NatsServer) -> None:
    """After a lost store a threshold put before it stayed in force, where no
    one could see it and a service started since had another."""
    nc = await nats.connect(private_nats.url)
    changed = asyncio.Event()
    live = LiveSettings(nc.jetstream(), DeciderSettings(compaction_threshold=0.8),
                        on_change=lambda _: changed.set())

    try:
        await live.start()
        await (await nc.jetstream().key_value(subjects.CONFIG_BUCKET)).put(
            "compaction_threshold", b"0.3")
        await settled(live, changed, 0.3, timeout_s=10)
        await live.watch_again()  # NATS back with its store: the bucket still says 0.3
        await (await nc.jetstream().key_value(subjects.CONFIG_BUCKET)).put(
            "compaction_cooldown_s", b"5")  # an event after the watch's start values
        while live.current.compaction_cooldown_s != 5:
            changed.clear()
            await changed.wait()
        assert live.current.compaction_threshold == 0.3
        await nc.jetstream().delete_key_value(subjects.CONFIG_BUCKET)  # the store lost
        await live.watch_again()
        await settled(live, changed, 0.8, timeout_s=10)
        assert live.current.compaction_cooldown_s == DeciderSettings().compaction_cooldown_s
    finally:
        await live.stop()
        await nc.close()


async def test_a_huge_value_refused_is_logged_cut_short(nc: NATS) -> None:
    """A megabyte put under a setting was written whole into each service's log."""
    live = LiveSettings(nc.jetstream(), DeciderSettings())
    huge = "9" * 1_000_000
    with structlog.testing.capture_logs() as logs:
        for key in ("compaction_cooldown_s", "COMPACTION_COOLDOWN_S", "nats_url"):
            live.apply(key, huge)
    refused = [entry for entry in logs if entry["event"].startswith("live_setting_")]
    assert len(refused) == 3
    assert len(refused[0]["value"]) < 300 and "1000000 characters" in refused[0]["value"]
    # Not a live setting's key: its value is not shown at all (it may be a secret).
    assert "value" not in refused[1] and "value" not in refused[2]


async def test_a_secret_put_among_the_live_settings_is_not_logged(nc: NATS) -> None:
    """The gateway watches the settings too: a token put there by mistake was
    copied into its log."""
    live = LiveSettings(nc.jetstream(), GatewaySettings())
    with structlog.testing.capture_logs() as logs:
        live.apply("gateway_token", "s3cret-token")
    assert [entry["event"] for entry in logs] == ["live_setting_ignored"]
    assert "s3cret-token" not in repr(logs)


async def test_only_live_settings_change_and_bad_bytes_stop_nothing(nc: NATS) -> None:
    """A setting read once at start is not half-changed; bytes that are not text
    are logged and the watch goes on."""
    changed = asyncio.Event()
    live = LiveSettings(nc.jetstream(), GeneratorSettings(), on_change=lambda _: changed.set())
    await live.start()
    kv = await nc.jetstream().key_value(subjects.CONFIG_BUCKET)
    try:
        await kv.put("compaction_mode", b"blocking")  # the state machine reads it once
        await kv.put("compaction_min_relief", b"\xff\xfe")
        await kv.put("compaction_threshold", b"0.5")
        async with asyncio.timeout(5):
            while live.current.compaction_threshold != 0.5:
                changed.clear()
                await changed.wait()
        assert live.current.compaction_mode == "background"
        await live.stop()
    finally:
        for key in ("compaction_mode", "compaction_min_relief", "compaction_threshold"):
            await kv.delete(key)


async def test_a_deletion_found_at_start_changes_nothing(nc: NATS) -> None:
    """The watch replays a key's deletion to a service starting later: it already
    has its start-up value, so nothing changes and nothing is announced."""
    kv = await config_bucket(nc.jetstream())  # made here if no test before made it
    await kv.put("compaction_threshold", b"0.5")
    await kv.delete("compaction_threshold")
    changes: list[DeciderSettings] = []
    arrived = asyncio.Event()

    def changed(settings: DeciderSettings) -> None:
        changes.append(settings)
        arrived.set()

    live = LiveSettings(nc.jetstream(), DeciderSettings(compaction_threshold=0.8),
                        on_change=changed)
    await live.start()
    try:
        await kv.put("compaction_cooldown_s", b"12")  # comes after the replayed deletion
        async with asyncio.timeout(5):
            while live.current.compaction_cooldown_s != 12:
                arrived.clear()
                await arrived.wait()
        assert [(c.compaction_threshold, c.compaction_cooldown_s) for c in changes] == [
            (0.8, 12)]
    finally:
        await live.stop()
        await kv.delete("compaction_cooldown_s")


async def test_a_state_change_that_cannot_be_published_still_happens(nats_url: str) -> None:
    """Publishing is for watchers: a closed connection must not leave a turn or a
    compaction half-way, its state changed here but its cleanup skipped."""
    closed = await nats.connect(nats_url)
    await closed.close()
    machine = SessionStates(Bus(closed, "generator"), "gen-test", CompactionMode.background)
    await machine.apply("s-unseen", Action.start_compaction)
    assert machine.current("s-unseen").visible.value == "compacting"
    await machine.apply("s-unseen", Action.complete_compaction)
    assert machine.current("s-unseen").visible.value == "idle"


def live_values(process: ServiceProcess, key: str) -> list[object]:
    """The values `key` took in a running service, in order, from its JSON log."""
    values = []
    for line in process.log().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == "live_setting_changed" and event.get("key") == key:
                values.append(event["value"])
    return values


async def went_through(process: ServiceProcess, key: str, values: list[object],
                       timeout_s: float = 15.0) -> None:
    """Wait until the service's setting has taken exactly `values`, in order."""
    async with asyncio.timeout(timeout_s):
        while True:
            seen = live_values(process, key)
            if len(seen) >= len(values):
                assert seen == values
                return
            await asyncio.sleep(0.05)  # polling the process's log


async def test_deleting_a_live_setting_restores_the_start_up_value(
        private_nats: NatsServer, stub_url: str) -> None:
    """`nats kv del config compaction_threshold`: every running service goes back
    to the value it started with (the deletion arrives as an empty value)."""
    key = "compaction_threshold"
    with running_system(private_nats.url, stub_url, env={"COMPACTION_THRESHOLD": "0.7"},
                        services=("generator", "decider")) as system:
        nc = await nats.connect(private_nats.url)
        try:
            kv = await nc.jetstream().key_value(subjects.CONFIG_BUCKET)
            await kv.put(key, b"0.3")
            await kv.delete(key)
            for name in ("generator", "decider"):
                await went_through(system[name], key, [0.3, 0.7])
            status = await nc.request(subjects.service_status("compaction-decider"), b"", timeout=5)
            assert json.loads(status.data)["threshold"] == 0.7
            await kv.put(key, b"0.4")
            # Taken in before the purge: a purge rolls up the key's earlier
            # values, so one not yet delivered to a watcher is never seen.
            await went_through(system["decider"], key, [0.3, 0.7, 0.4])
            await kv.purge(key)
            await went_through(system["decider"], key, [0.3, 0.7, 0.4, 0.7])
            assert "live_setting_rejected" not in system["decider"].log()
        finally:
            await nc.close()


async def test_a_setting_has_one_key_its_lower_case_name(nc: NATS) -> None:
    """`COMPACTION_THRESHOLD` is not the threshold's key: were it applied, the
    setting would have two keys, put and deleted apart, and its value would
    be whichever came last. It is logged and ignored."""
    kv = await config_bucket(nc.jetstream())
    changed = asyncio.Event()
    live = LiveSettings(nc.jetstream(), DeciderSettings(compaction_threshold=0.8),
                        on_change=lambda _: changed.set())
    await live.start()
    try:
        with structlog.testing.capture_logs() as logs:
            await kv.put("compaction_threshold", b"0.5")
            await kv.put("COMPACTION_THRESHOLD", b"0.6")
            await kv.delete("COMPACTION_THRESHOLD")
            await kv.put("compaction_cooldown_s", b"12")  # comes after the others
            async with asyncio.timeout(5):
                while live.current.compaction_cooldown_s != 12:
                    changed.clear()
                    await changed.wait()
        assert live.current.compaction_threshold == 0.5
        assert [(e["event"], e.get("value")) for e in logs
                if e.get("key") == "COMPACTION_THRESHOLD"] == [("live_setting_ignored", None)]
    finally:
        await live.stop()
        for key in ("compaction_threshold", "COMPACTION_THRESHOLD", "compaction_cooldown_s"):
            await kv.delete(key)
