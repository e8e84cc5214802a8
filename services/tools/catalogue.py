"""The tools themselves: plain functions with an Ollama-style definition.

Each takes its arguments as keyword arguments and returns text; raising
`ToolFailure` (or anything else) becomes an error result for the model.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError


class ToolFailure(Exception):
    pass


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[..., str]

    def definition(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters,
        }}


def current_time(timezone: str = "UTC") -> str:
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as err:
        raise ToolFailure(f"unknown time zone '{timezone}'") from err
    return datetime.now(UTC).astimezone(zone).isoformat(timespec="seconds")


Number = int | float
# `**` gives a complex number for a fractional power of a negative number.
_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number | complex]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg,
}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
# Whole numbers up to about 4,200 digits. Powers of powers stay within 200
# characters yet grow without bound, and CPython multiplies big numbers
# holding the GIL: one call would stop the whole process, not just a thread.
MAX_RESULT_BITS = 14_000


def calculate(expression: str) -> str:
    """Arithmetic only: numbers, + - * / // % ** and parentheses. No names, no calls.
    Whole numbers stay exact; a decimal point, `/` or a negative power makes a float."""
    _require_text("expression", expression)
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolFailure(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
        return repr(_evaluate(tree.body))
    except SyntaxError as err:
        raise ToolFailure(f"not an arithmetic expression: {expression!r}") from err
    except ZeroDivisionError as err:
        raise ToolFailure("division by zero") from err
    except OverflowError as err:
        raise ToolFailure("result too large") from err


def _evaluate(node: ast.AST) -> Number:
    """Every value on the way is checked, not just the answer: an infinity
    divided into 0.0, or a complex number floor-divided, hides what went wrong."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return _real(node.value)  # `1e999` reads as infinity
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolFailure(f"exponent larger than {MAX_EXPONENT}")
        if _result_bits(node.op, left, right) > MAX_RESULT_BITS:
            raise ToolFailure(f"result larger than {MAX_RESULT_BITS} bits")
        return _real(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ToolFailure(f"unsupported element in expression: {type(node).__name__}")


def _real(value: Number | complex) -> Number:
    """Float arithmetic overflows to infinity (and infinity minus infinity to
    nan) without raising: neither, nor a complex number, is an answer."""
    if isinstance(value, complex) or (isinstance(value, float) and math.isnan(value)):
        raise ToolFailure("not a real number")
    if isinstance(value, float) and math.isinf(value):
        raise ToolFailure("result too large")
    return value


def _result_bits(op: ast.operator, left: Number, right: Number) -> int:
    """An upper bound on the size of a whole-number result, before it is made
    (0 where it cannot grow: floats overflow instead, the rest shrink)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if isinstance(op, ast.Pow) and right > 0:
        return abs(left).bit_length() * right
    if isinstance(op, ast.Mult):
        return abs(left).bit_length() + abs(right).bit_length()
    return 0


def word_count(text: str) -> str:
    _require_text("text", text)
    return f"{len(text.split())} words, {_line_count(text)} lines, {len(text)} characters"


def _line_count(text: str) -> int:
    """Lines as a text editor shows them: ended by \\n, \\r\\n or \\r, the last
    one counted even without an ending. (`str.splitlines` also breaks at \\v,
    \\f, \\x1c-\\x1e, \\x85, U+2028 and U+2029, where editors and `wc -l` do not.)"""
    unified = text.replace("\r\n", "\n").replace("\r", "\n")
    return unified.count("\n") + (0 if unified.endswith("\n") or not unified else 1)


def _require_text(name: str, value: object) -> None:
    """The model sends JSON: a number where text belongs is its mistake, to
    be told as one, not a failure of the tool."""
    if not isinstance(value, str):
        raise ToolFailure(f"bad arguments: {name} must be a string, not {type(value).__name__}")


def _string_param(name: str, description: str) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"type": "string",
                                                    "description": description}},
            "required": [name]}


TOOLS = {tool.name: tool for tool in (
    Tool("current_time", "The current date and time in a time zone (IANA name, default UTC).",
         {"type": "object", "properties": {"timezone": {"type": "string"}}}, current_time),
    Tool("calculate", "Evaluate an arithmetic expression (+ - * / // % ** and ()). Exact "
         "with whole numbers; a decimal point, / or a negative power makes it floating point, "
         "good to about 15 significant digits.",
         _string_param("expression", "for example (3 + 4) * 2"), calculate),
    Tool("word_count", "Count the words, lines and characters of a text.",
         _string_param("text", "the text to count"), word_count),
)}
