"""The tool registry of a run (``tools.registry``): tools by name, called concurrently, errors as results."""

from __future__ import annotations

import concurrent.futures
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_zcpo.agent_tools.base import Tool, ToolResult, call_tool
from megatron_zcpo.agent_tools.config import ToolsConfig
from megatron_zcpo.agent_tools.parser import ToolCall

_END_S = 5.0  # what a self-limiting tool may take past its limit to end its processes


def build_tool(name: str, spec: Dict) -> Tool:
    """The tool ``spec`` describes (a ``tools.registry`` entry; see :class:`ToolsConfig`)."""
    from megatron_zcpo.agent_tools.python_function import PythonFunctionTool, calculate, load_function

    options = {k: v for k, v in spec.items() if k != "kind"}
    if spec["kind"] == "calculator":
        return PythonFunctionTool(name, calculate)
    if spec["kind"] == "python":
        return PythonFunctionTool(name, load_function(options["function"]))
    from megatron_zcpo.agent_tools.sandbox import OPTIONS, CodeTool

    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"tools.registry.{name}: unknown options {sorted(unknown)} for kind code (known: {OPTIONS})")
    return CodeTool(name, **options)


def tool_problems(config: ToolsConfig) -> List[str]:
    """What keeps the tools of ``config`` from working here, each under its key ([] when nothing
    does): a tool that cannot be built, a code tool whose isolation cannot be had (the message says
    what is missing and how to install it)."""
    return _checked_tools(config)[1]


def _checked_tools(config: ToolsConfig) -> Tuple[List[Tool], List[str]]:
    tools, problems = [], []
    for name, spec in config.registry.items():
        try:
            tool = build_tool(name, spec)
            tool.check()
            tools.append(tool)
        except Exception as error:
            text = str(error)
            problems.append(text if text.startswith(f"tools.registry.{name}") else f"tools.registry.{name}: {text}")
    return tools, problems


class ToolRegistry:
    """The run's tools by name; :meth:`call_all` runs a turn's calls and never raises for a tool's failure."""

    def __init__(self, tools: Sequence[Tool], timeout_s: float = 10.0, max_result_chars: int = 2000, max_workers=4):
        self.tools: Dict[str, Tool] = {tool.name: tool for tool in tools}
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="zcpo-tool")

    @classmethod
    def from_config(cls, config: ToolsConfig) -> ToolRegistry:
        """The registry of ``config``; raises ValueError naming the key of a tool that cannot work here
        (:func:`tool_problems`: a code tool without its isolation is refused, never run unisolated)."""
        tools, problems = _checked_tools(config)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(tools, config.timeout_s, config.max_result_chars, config.max_workers)

    def call_all(self, calls: Sequence[Optional[ToolCall]]) -> List[Optional[ToolResult]]:
        """Each call's result (None for None), run concurrently: an unknown tool, an unparsable call, a
        tool that raises, hangs past ``timeout_s`` or returns garbage each give an error result."""
        futures = [None if call is None else self._pool.submit(self.call, call) for call in calls]
        return [None if future is None else future.result() for future in futures]

    def call(self, call: ToolCall) -> ToolResult:
        """One call's result (see :meth:`call_all`)."""
        if call.error is not None:
            return ToolResult(f"error: {call.error}", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return ToolResult(f"error: unknown tool {call.name!r} (tools: {known})", error=True)
        limit = getattr(tool, "time_limit_s", None)  # (duck-typed tools have none)
        timeout_s = self.timeout_s if limit is None else max(self.timeout_s, limit + _END_S)
        return call_tool(tool, call.arguments, timeout_s, self.max_result_chars)

    def close(self) -> None:
        """Stop taking calls (a hung in-process call's thread is left to finish on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
