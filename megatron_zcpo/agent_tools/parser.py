"""Tool calls in a policy turn's text: ``<tool_call>...</tool_call>`` in the Hermes (JSON) or plain format."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's ``name`` and its ``arguments`` (dict or string); ``error`` when the
    call's text could not be parsed (then the tool's turn says so)."""

    name: str
    arguments: Any
    error: Optional[str] = None


def parse_tool_call(text: str, call_format: str, start: str = "<tool_call>", end: str = "</tool_call>"):
    """The last complete call in ``text``, or None when the turn calls no tool.

    A turn calls a tool when it ends with ``end`` (after trailing whitespace) and holds a ``start``
    before it. "hermes": the body is JSON ``{"name": str, "arguments": dict}``; "plain": ``NAME ARGS``
    (the arguments are the rest of the body, a string). A body that does not parse gives a ToolCall
    with ``error`` set.
    """
    stripped = text.rstrip()
    if not stripped.endswith(end):
        return None
    opening = stripped.rfind(start, 0, len(stripped) - len(end))
    if opening < 0:
        return None
    body = stripped[opening + len(start) : len(stripped) - len(end)].strip()
    if call_format == "plain":
        name, _, arguments = body.partition(" ")
        if not name:
            return ToolCall("", None, "the tool call names no tool")
        return ToolCall(name, arguments.strip())
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall("", None, f"the tool call is not JSON ({error.msg})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", None, 'the tool call needs {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded once more
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return ToolCall(call["name"], arguments)
