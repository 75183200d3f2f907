"""`ToolEnv`: an environment whose actions are tool calls, the base of the built-in ones.

A turn that ends on `call_end` is a call: the text after its last `call_start` names the tool
and its arguments (`name arguments`; with one tool, the arguments alone). The tool's answer,
framed by `format_result`, is the observation. A call with no `call_start`, or naming no tool,
gets `format_result("")` and counts as malformed; what the tool raises (or a result that is not
a string) fails the episode — the tool is the untrusted part. Each step reports `tool_calls`,
`tool_call_malformed` and whatever `grade` adds (e.g. whether the call was the right one), which
the run sums per step (`env_info_*` metrics, also per call).

Subclass it: set `tools` (built in `make_tools`), `call_start` / `call_end` (each one token of
the run's tokenizer: `call_end` is the turn's stop text) and, if wanted, `format_result`/`grade`.
"""

from __future__ import annotations

from typing import Any

from rlfusion.rl.env import EnvStep
from rlfusion.rl.problem import Problem
from rlfusion.rl.tools import Tool


class ToolEnv:
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    stop: tuple[str, ...] = (call_end,)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.stop = (cls.call_end,)

    def __init__(self) -> None:
        self.tools: dict[str, Tool] = {t.name: t for t in self.make_tools()}
        self.problem: Problem | None = None

    def make_tools(self) -> list[Tool]:
        raise NotImplementedError("a ToolEnv subclass lists its tools in make_tools()")

    def reset(self, problem: Problem) -> None:
        self.problem = problem

    def step(self, action: str) -> EnvStep:
        call = self.parse(action)
        if call is None:
            return EnvStep(self.format_result(""), info={"tool_calls": 1.0, "tool_call_malformed": 1.0})
        name, arguments = call
        result = self.tools[name](arguments)
        if not isinstance(result, str):
            raise TypeError(f"tool {name!r} returned a {type(result).__name__}, not a str")
        return EnvStep(self.format_result(result),
                       info={"tool_calls": 1.0, "tool_call_malformed": 0.0, **self.grade(name, arguments, result)})

    def parse(self, action: str) -> tuple[str, str] | None:
        """`(tool name, arguments)` of the call `action` ends with, or None (malformed)."""
        body = action[:-len(self.call_end)] if action.endswith(self.call_end) else action
        start = body.rfind(self.call_start)
        if start < 0:
            return None
        call = body[start + len(self.call_start):]
        if len(self.tools) == 1:
            return next(iter(self.tools)), call
        name, _, arguments = call.strip().partition(" ")
        return (name, arguments) if name in self.tools else None

    def format_result(self, result: str) -> str:
        """The observation for a tool's answer."""
        return result

    def grade(self, name: str, arguments: str, result: str) -> dict[str, float]:
        """Numbers about a well-formed call for the metrics (none by default)."""
        return {}


class PythonEnv(ToolEnv):
    """`env = "rlfusion.rl.tools.tool_env:PythonEnv"`: the policy runs Python in the sandbox
    (`python_tool.PythonTool`) by writing `<tool_call>code</tool_call>` (special tokens of
    Qwen-style tokenizers, one token each); the observation is what the code printed, framed as
    `<tool_response>...</tool_response>`. For other call texts, subclass it and set `call_start` /
    `call_end` (each one token of your tokenizer) and the tool's limits in `make_tools`."""

    def make_tools(self) -> list[Tool]:
        from rlfusion.rl.tools.python_tool import PythonTool

        return [PythonTool()]

    def format_result(self, result: str) -> str:
        return f"<tool_response>\n{result}</tool_response>"
