"""Tools a policy calls inside an episode (`rl/tools/tool_env.ToolEnv` runs them): a tool is any
object with a `name` and `__call__(arguments: str) -> str` (the text the policy sees back).

A tool signals a failure it cannot turn into an observation by raising `ToolError` (or anything
else): the episode fails, not the run. Built in: `calculator.Calculator` (sums for the arithmetic
task) and `python_tool.PythonTool` (a sandboxed Python subprocess).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class ToolError(Exception):
    """A tool could not produce an observation (the sandbox failed to start, a limit it cannot
    report as text); the episode that called it fails."""


@runtime_checkable
class Tool(Protocol):
    name: str

    def __call__(self, arguments: str) -> str: ...
