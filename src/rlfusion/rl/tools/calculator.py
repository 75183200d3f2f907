"""The calculator of the arithmetic task: a tool that adds, and the environment that offers it.

    prompt       17+5+23+8=
    episode      [17+5+23+8]=53;#53          the call, then the observation "=53;", then the answer
    or           [17+5+23]=45;45+8=53;#53    a call over some terms, the rest by hand

The policy ends a call with "]" (the turn's stop text); the observation is `=` the sum `;`.
`CalculatorEnv` grades each call: `tool_call_correct` is 1 when its sum is the problem's answer
(every term copied right), so the share of correct calls shows RL learning how to call it.
"""

from __future__ import annotations

from rlfusion.rl.tools.tool_env import ToolEnv

MAX_TERMS = 64
CALCULATOR_ENV = "rlfusion.rl.tools.calculator:CalculatorEnv"  # its `env=` spec


class Calculator:
    """Sums of non-negative integers joined by '+'; "" for anything else (a malformed call)."""

    name = "calc"

    def __call__(self, arguments: str) -> str:
        terms = arguments.split("+")
        if not 1 <= len(terms) <= MAX_TERMS or not all(t.isdigit() and t.isascii() and len(t) <= 12 for t in terms):
            return ""
        return str(sum(int(t) for t in terms))


class CalculatorEnv(ToolEnv):
    """`env = "rlfusion.rl.tools.calculator:CalculatorEnv"`: the arithmetic task with a calculator."""

    call_start = "["
    call_end = "]"

    def make_tools(self) -> list:
        return [Calculator()]

    def format_result(self, result: str) -> str:
        return f"={result};"

    def grade(self, name: str, arguments: str, result: str) -> dict[str, float]:
        return {"tool_call_correct": float(self.problem is not None and result == self.problem.answer)}
