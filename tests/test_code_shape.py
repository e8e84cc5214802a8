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


# The page's script, in services/ too, is held to the same length. JavaScript
# has no parser here, so a function is read by the house's layout: it starts
# on a line declaring it (a function, a method, an arrow function bound to a
# name) and ends at the first later line that is its closing brace at its own
# indentation.
STATIC = ROOT / "services" / "gateway" / "static"
JS_FUNCTION = re.compile(
    r"^(?P<indent> *)(?:export )?(?:async )?(?:function\*? (?P<function>\w+)\("
    r"|(?:static |get |set )?(?P<method>(?!if\b|for\b|while\b|switch\b|catch\b)\w+)\(.*\) \{$"
    r"|const (?P<arrow>\w+) = (?:async )?\(.*\) => \{$)")


def js_functions(text: str) -> Iterator[tuple[str, int]]:
    """(name, lines) for each function of a module of the page, nested ones included."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        found = JS_FUNCTION.match(line)
        if not found:
            continue
        closing = found["indent"] + "}"
        end = next((i for i in range(start + 1, len(lines))
                    if lines[i].startswith(closing) and not lines[i][len(closing):].strip(";),")),
                   None)
        assert end is not None, f"no end found for the function on line {start + 1}: {line!r}"
        name = found["function"] or found["method"] or found["arrow"]
        yield f"{name}:{start + 1}", end - start + 1


def test_no_function_of_the_page_is_longer_than_forty_lines() -> None:
    long = {f"{path.name}::{name}": lines
            for path in sorted(STATIC.glob("*.js"))
            for name, lines in js_functions(path.read_text())
            if lines > MAX_LINES}
    assert not long, f"functions of the page over {MAX_LINES} lines (split them): {long}"


def test_a_function_of_the_page_is_measured_from_its_line_to_its_closing_brace() -> None:
    sample = ("export async function f(a, { b = 1 } = {}) {\n  if (a) {\n    g();\n  }\n}\n"
              "class A {\n  constructor(x) {\n    this.x = x;\n  }\n\n"
              "  get y() {\n    return 1;\n  }\n}\n"
              "const h = (x) => {\n  return x;\n};\n")
    assert list(js_functions(sample)) == [
        ("f:1", 5), ("constructor:7", 3), ("y:11", 3), ("h:15", 3)]


def imports_of_the_page() -> dict[str, set[str]]:
    graph = {}
    for path in STATIC.glob("*.js"):
        named = re.findall(r'^import\b[^;]*?from "\./(\w+)\.js";', path.read_text(), re.M | re.S)
        graph[path.stem] = set(named)
    return graph


def test_the_modules_of_the_page_import_each_other_in_layers_not_circles() -> None:
    graph = imports_of_the_page()
    assert graph["chat"] >= {"answer", "shared"}, "the imports were not read"
    placed: list[str] = []
    while len(placed) < len(graph):  # take, each round, the modules whose imports are all placed
        ready = sorted(name for name, wanted in graph.items()
                       if name not in placed and wanted <= set(placed))
        circle = sorted(set(graph) - set(placed))
        assert ready, f"modules importing each other in a circle: {circle}"
        placed += ready


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
