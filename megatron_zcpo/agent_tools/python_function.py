"""Tools that are Python functions: any ``pkg.module:function``, and the calculator."""

from __future__ import annotations

import ast
import importlib
import operator
from typing import Any, Callable, Dict

from megatron_zcpo.agent_tools.base import Tool


def load_function(path: str) -> Callable[..., Any]:
    """The function named ``"pkg.module:function"``; raises ValueError naming what is missing."""
    module_name, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"tool function {path!r} cannot be loaded: {error}") from error
    if not callable(function):
        raise ValueError(f"tool function {path!r} is not callable")
    return function


class PythonFunctionTool(Tool):
    """Calls ``function(**arguments)`` for a JSON call (a dict) or ``function(arguments)`` for a string."""

    def __init__(self, name: str, function: Callable[..., Any]):
        self.name = name
        self.function = function

    def run(self, arguments: Any) -> Any:
        if isinstance(arguments, dict):
            return self.function(**arguments)
        return self.function(arguments)


_OPERATORS: Dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Div: operator.truediv,
}
MAX_CALCULATOR_DIGITS = 60  # larger intermediate results are refused (a product tower would not end)
# What an expression may hold. Checked before Python's parser sees it: the parser warns (SyntaxWarning,
# printed on the trainer's stderr) about string escapes and numbers run into names ("1if"), and with
# only these characters neither can be written.
_CALCULATOR_CHARACTERS = frozenset("0123456789+-*/%()._eE \t")


def calculate(expression: Any = None, **arguments: Any) -> Any:
    """The value of an arithmetic ``expression`` of numbers, + - * / // %, unary minus and parentheses.

    Accepts the expression as a string or as ``{"expression": "..."}``; raises ValueError on anything
    else (names, calls, powers, results over MAX_CALCULATOR_DIGITS digits).
    """
    if expression is None:
        expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ValueError(f"the calculator needs an expression string, got {expression!r}")

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            result = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            result = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        else:
            raise ValueError(f"the calculator does not know {ast.dump(node)[:60]}")
        if isinstance(result, int) and abs(result) >= 10**MAX_CALCULATOR_DIGITS:
            raise ValueError("the result is too large")
        return result

    unknown = sorted(set(expression) - _CALCULATOR_CHARACTERS)
    if unknown:
        raise ValueError(f"the calculator does not know {''.join(unknown)[:20]!r} (numbers, + - * / // %, parentheses)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {expression!r}: {error.msg}") from None
    return value(tree.body)
