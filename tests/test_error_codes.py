"""Every error a reply may carry is named once, in `ErrorCode`: the gateway
maps each to an HTTP status and the metrics count each under its own label."""

from __future__ import annotations

import ast
from pathlib import Path

from schemas.messages import ErrorCode
from services.gateway.answering import ERROR_STATUS
from services.shared.metrics import error_label
from tests.processes import REPO_ROOT


def test_each_code_has_a_status_and_a_label_of_its_own() -> None:
    """`storage_full` and `nats_unavailable` were counted as `other`."""
    for code in ErrorCode:
        assert code in ERROR_STATUS, code
        assert error_label(code) == code.value
    assert error_label("someone_elses") == "other"


def error_code_literals(path: Path) -> set[str]:
    """Strings passed as `error_code=` in a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "error_code" \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.add(node.value.value)
    return found


def test_the_codes_written_out_in_the_code_are_all_named() -> None:
    """Elsewhere the codes are `ErrorCode` members, which mypy checks."""
    sources = [*REPO_ROOT.glob("services/**/*.py"), *REPO_ROOT.glob("schemas/*.py")]
    written = set().union(*(error_code_literals(path) for path in sources))
    assert written, "no error_code= found: the walk is broken"
    assert written <= {code.value for code in ErrorCode}
