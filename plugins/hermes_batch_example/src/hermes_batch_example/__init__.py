"""An example hermes-batch plugin: one quality filter and one toolset."""

from __future__ import annotations

import ast
import operator
from typing import Optional

import hermes_batch
from hermes_batch import Filter, Toolset, Trajectory


@hermes_batch.hookimpl
def register_filters(register):
    register(MaxToolFailuresFilter)


@hermes_batch.hookimpl
def register_toolsets(register):
    register(Toolset("calculator", "Exact arithmetic without a sandbox.", (calculate,)))


class MaxToolFailuresFilter(Filter):
    """Discard samples in which more than half of the tool calls failed."""

    name = "max-tool-failures"
    description = "Discard samples in which more than half of the tool calls failed."

    def check(self, trajectory: Trajectory) -> Optional[str]:
        calls = sum(stat.count for stat in trajectory.tool_stats.values())
        failures = sum(stat.failure for stat in trajectory.tool_stats.values())
        if calls and failures * 2 > calls:
            return f"{failures} of {calls} tool calls failed"
        return None


@hermes_batch.tool
async def calculate(expression: str) -> dict:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return the result.

    Args:
        expression: For example (2 + 3) * 4
    """
    try:
        return {"result": evaluate(expression), "error": None}
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
        return {"result": None, "error": f"cannot evaluate: {exc}"}


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> float:
    """Evaluate + - * / // % ** and parentheses on numbers; anything else is refused."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            right = walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](walk(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported syntax: {type(node).__name__}")

    return walk(ast.parse(expression, mode="eval"))
