"""Settings come from the environment, then an optional YAML file, then defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.compaction_decider.settings import DeciderSettings
from services.gateway.settings import GatewaySettings
from services.generator.settings import GeneratorSettings
from services.shared.runner import settings_refused
from services.shared.settings import shown_url
from tests.processes import REPO_ROOT
from tests.system import SERVICE_MODULES


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NATS_URL", "OLLAMA_HOST", "MODEL", "NUM_CTX", "GATEWAY_HOST", "GATEWAY_PORT",
                 "COMPACTION_THRESHOLD", "COMPACTION_TAIL_TURNS", "CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_safe() -> None:
    gateway = GatewaySettings()
    assert gateway.gateway_host == "127.0.0.1"
    assert gateway.gateway_port == 8080
    assert DeciderSettings().compaction_threshold == 0.8
    generator = GeneratorSettings()
    assert generator.compaction_tail_turns == 4
    assert generator.ollama_host == "http://127.0.0.1:11434"


def test_the_decider_waits_out_a_whole_compaction_before_asking_again() -> None:
    """A request outlives its summary's limit and the lock wait before it, by default."""
    generator = GeneratorSettings()
    longest = generator.summary_timeout_s + generator.lock_wait_s
    assert DeciderSettings().compaction_result_timeout_s > longest


def test_a_killed_generators_session_waits_ten_seconds_at_most_by_default() -> None:
    """The ack wait is that wait (row failover_after_kill: 30 s before); beaten
    every third of it, a query in hand is redelivered only after a stall
    longer than the default lease survives."""
    generator = GeneratorSettings()
    assert generator.query_ack_wait_s <= 10
    assert generator.query_ack_wait_s * 2 / 3 >= generator.lock_lease_s


def test_environment_variables_set_each_pinned_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://elsewhere:4222")
    monkeypatch.setenv("OLLAMA_HOST", "http://gpu-box:11434")
    monkeypatch.setenv("MODEL", "qwen3")
    monkeypatch.setenv("NUM_CTX", "32768")
    monkeypatch.setenv("COMPACTION_TAIL_TURNS", "6")
    monkeypatch.setenv("COMPACTION_THRESHOLD", "0.7")
    monkeypatch.setenv("GATEWAY_PORT", "9000")
    generator = GeneratorSettings()
    assert (generator.nats_url, generator.ollama_host, generator.model, generator.num_ctx,
            generator.compaction_tail_turns) == (
        "nats://elsewhere:4222", "http://gpu-box:11434", "qwen3", 32768, 6)
    assert DeciderSettings().compaction_threshold == 0.7
    assert GatewaySettings().gateway_port == 9000


def test_yaml_file_is_read_and_environment_wins(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "chat.yaml"
    config.write_text("model: from-yaml\nNUM_CTX: 4096\ncompaction_threshold: 0.5\n")
    monkeypatch.setenv("CONFIG_FILE", str(config))
    monkeypatch.setenv("MODEL", "from-env")
    generator = GeneratorSettings()
    assert generator.model == "from-env"
    assert generator.num_ctx == 4096
    assert DeciderSettings().compaction_threshold == 0.5


def test_invalid_settings_fail_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPACTION_THRESHOLD", "1.5")
    with pytest.raises(ValueError, match="compaction_threshold"):
        DeciderSettings()


@pytest.mark.parametrize("number", ["1e999", "inf", "nan"])
def test_a_number_must_be_finite(number: str) -> None:
    """A cooldown read as infinity was taken, and no compaction was asked for again."""
    with pytest.raises(ValidationError):
        DeciderSettings(compaction_cooldown_s=number)


@pytest.mark.parametrize("settings", [GeneratorSettings, GatewaySettings])
def test_a_window_too_small_to_work_in_is_refused_at_the_start(settings: type) -> None:
    """NUM_CTX 256 left a prompt budget of one token: every message was refused
    413; a summariser's window under about 900 made every compaction fail."""
    with pytest.raises(ValueError, match="num_ctx"):
        settings(num_ctx=256)
    with pytest.raises(ValueError, match="leaves 392 tokens of NUM_CTX 8192"):
        settings(num_ctx=8192, output_headroom=7800)
    assert settings(num_ctx=1024).num_ctx == 1024
    assert settings(num_ctx=8192, output_headroom=7680).output_headroom == 7680


def test_a_summariser_window_too_small_to_work_in_is_refused() -> None:
    with pytest.raises(ValueError, match="compaction_num_ctx"):
        GeneratorSettings(compaction_num_ctx=512)


@pytest.mark.parametrize("module", sorted(SERVICE_MODULES.values()))
def test_a_service_with_a_bad_setting_says_which_in_a_line_and_stops(module: str) -> None:
    env = {**os.environ, "JETSTREAM_REPLICAS": "9", "NATS_URL": "nats://127.0.0.1:1"}
    done = subprocess.run([sys.executable, "-m", module], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "JETSTREAM_REPLICAS='9': Input should be less than or equal to 5" in done.stderr
    assert "not started, 1 setting(s) not valid" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("token", ["two words", "€uro", "tab\there"])
def test_a_token_no_header_or_cookie_can_carry_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="printable ASCII"):
        GatewaySettings(gateway_token=token)
    assert GatewaySettings(gateway_token="").gateway_token is None


def test_a_log_level_no_logger_knows_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as info, a typo in LOG_LEVEL hid the debug lines it asked for."""
    monkeypatch.setenv("LOG_LEVEL", "DEBUG")
    assert DeciderSettings().log_level == "debug"
    monkeypatch.setenv("LOG_LEVEL", "verbose")
    with pytest.raises(ValueError, match="log_level"):
        DeciderSettings()


def test_a_secret_is_never_echoed_in_a_log_or_a_refusal() -> None:
    """NATS_URL may carry a password; a refused token was written out whole."""
    assert shown_url("nats://tools:pw@127.0.0.1:4222,tok@h:1") == (
        "nats://tools:***@127.0.0.1:4222,nats://***@h:1")
    assert shown_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    with pytest.raises(ValidationError) as refused:
        GatewaySettings(gateway_token="my secret passphrase")
    told = settings_refused(refused.value)
    assert "GATEWAY_TOKEN=(hidden)" in told and "passphrase" not in told
