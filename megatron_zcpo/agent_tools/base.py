"""What a tool is and how it is called: a result or an error text, never an exception, within a time limit."""

from __future__ import annotations

import abc
import math
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer as the text of the tool's turn; ``error``: the call failed (the text says why)."""

    text: str
    error: bool = False


class Tool(abc.ABC):
    """A named tool: ``run(arguments)`` returns what the tool's turn shows (any str, int or float)."""

    name: str = "tool"
    # A tool that ends its own calls within this many seconds (the code tool): the registry waits that
    # long, plus a margin for the end of its processes, even past tools.timeout_s. None: it may hang.
    time_limit_s: Optional[float] = None

    @abc.abstractmethod
    def run(self, arguments: Any) -> Any:
        """The tool's result for ``arguments`` (a dict from a JSON call, or a string); may raise."""

    def check(self) -> None:  # noqa: B027 - a tool that needs nothing of the host has nothing to check
        """Raise, saying what is missing, when the tool cannot work here (run once at start-up)."""


def as_result_text(value: Any, max_chars: int) -> ToolResult:
    """``value`` as a turn's text: strings and finite numbers pass (cut at ``max_chars``), anything else
    (None, NaN, objects, bytes that are not UTF-8) is garbage and gives an error turn."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return ToolResult("error: the tool returned bytes that are not UTF-8", error=True)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return ToolResult(f"error: the tool returned {type(value).__name__}, not text or a number", error=True)
    if isinstance(value, float) and not math.isfinite(value):
        return ToolResult(f"error: the tool returned {value}", error=True)
    if isinstance(value, float) and value == int(value) and abs(value) < 2**53:
        value = int(value)
    text = str(value).replace("\x00", "")
    return ToolResult(text[:max_chars] + (" ...[cut]" if len(text) > max_chars else ""))


def call_tool(tool: Tool, arguments: Any, timeout_s: float, max_chars: int) -> ToolResult:
    """Run ``tool`` on ``arguments`` in a daemon thread for at most ``timeout_s`` seconds.

    An exception or a hang becomes an error result (a hung in-process call keeps its daemon thread
    until it returns, never the run: tools that may hang for good belong in their own process, as the
    code tool is).
    """
    outcome: Dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = tool.run(arguments)
        except BaseException as error:  # any failure of the tool is the policy's information, not the run's end
            outcome["error"] = error

    thread = threading.Thread(target=run, name=f"zcpo-tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ToolResult(f"error: the tool {tool.name!r} did not answer within {timeout_s:g} s", error=True)
    if "error" in outcome:
        error = outcome["error"]
        return ToolResult(f"error: {type(error).__name__}: {error}"[:max_chars], error=True)
    value = outcome.get("value")
    if isinstance(value, ToolResult):  # a tool that tells its own errors apart (the code tool)
        return ToolResult(value.text[:max_chars], value.error)
    return as_result_text(value, max_chars)
