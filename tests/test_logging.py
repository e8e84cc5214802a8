"""The services' log output when nobody can read it any more."""

from __future__ import annotations

import io

import pytest
import structlog

from services.shared.logging import Unfailing, configure_logging


class HungUp(io.StringIO):
    """A terminal that was closed: every write fails as a real one does (EIO)."""

    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")

    def flush(self) -> None:
        raise OSError(5, "Input/output error")


def test_a_closed_terminal_does_not_fail_a_services_log_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", HungUp())
    configure_logging("generator", fmt="json")
    try:
        structlog.get_logger().info("service_stopping")  # what a draining service says
    finally:
        structlog.reset_defaults()


def test_lines_still_reach_a_working_stream() -> None:
    kept = io.StringIO()
    stream = Unfailing(kept)
    assert stream.write("line\n") == 5
    stream.flush()
    assert kept.getvalue() == "line\n"
