"""Short functions are a rule of the house: this holds every function and
method in services/ and schemas/ to it, counting from its `def` (or first
decorator) to its last line, docstring included."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("services", "schemas")
MAX_LINES = 40

# Left long on purpose, each with its reason. A function leaves this list as
# soon as it is short again (the test below says so).
ALLOWED: dict[str, str] = {}


def functions(path: Path) -> Iterator[tuple[str, int]]:
    """(qualified name, lines) for each function in the module, nested ones included."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                name = f"{prefix}{child.name}"
                yield name, (child.end_lineno or child.lineno) - first + 1
                name += "."
            elif isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}."
            yield from walk(child, name)

    yield from walk(ast.parse(path.read_text(), str(path)), "")


def lengths() -> dict[str, int]:
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            for name, lines in functions(path):
                found[f"{module}::{name}"] = lines
    return found


def test_no_function_in_services_or_schemas_is_longer_than_forty_lines() -> None:
    long = {name: lines for name, lines in lengths().items()
            if lines > MAX_LINES and name not in ALLOWED}
    assert not long, f"functions over {MAX_LINES} lines (split them): {long}"


def test_every_allowed_long_function_is_still_long() -> None:
    found = lengths()
    stale = [name for name in ALLOWED if found.get(name, 0) <= MAX_LINES]
    assert not stale, f"short again, or gone: take them off ALLOWED: {stale}"


def test_nested_functions_and_methods_are_measured_with_their_decorators(
        tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("class A:\n    @staticmethod\n    def f():\n"
                      "        def g():\n            pass\n        return g\n")
    assert dict(functions(sample)) == {"A.f": 5, "A.f.g": 2}


# nats-py's flush() writes its PING ahead of commands still pending, so it can
# return before a subscription just made reaches the server; confirm with
# services.shared.bus.round_trip instead (its docstring says why).
NATS_FLUSH = re.compile(r"await \w+\.flush\(")


def test_nothing_confirms_a_subscription_with_nats_pys_flush() -> None:
    found = [f"{path.relative_to(ROOT)}:{number}"
             for folder in ("services", "scripts", "tests")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if NATS_FLUSH.search(line)]
    assert not found, f"use round_trip(nc), not nc.flush(): {found}"


# ARCHITECTURE.md is a map, read in a quarter of an hour; accounts of
# measurements belong in docs/performance.md.
MAP_LINES = 250


def test_the_architecture_map_stays_a_map() -> None:
    lines = len((ROOT / "ARCHITECTURE.md").read_text().splitlines())
    assert lines <= MAP_LINES, f"ARCHITECTURE.md has {lines} lines: move detail out"
