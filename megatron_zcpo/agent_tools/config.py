"""The ``tools:`` section of the run configuration: multi-turn tool use and the tool registry."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

CALL_FORMATS = ("hermes", "plain")
TOOL_KINDS = ("calculator", "python", "code")


@dataclasses.dataclass
class ToolsConfig:
    """Multi-turn rollouts with tools (off by default: one response per prompt).

    enabled: each sample becomes a trajectory of up to ``max_turns`` policy turns; after a turn that
        ends in a tool call the tool's result is appended as a turn the loss does not train on.
    max_turns: policy turns per trajectory (a call in the last turn is not run).
    max_total_tokens: the token budget of a trajectory, prompt and every turn (at most the servers'
        context length); each turn asks for min(rollout.max_new_tokens, what the budget leaves).
    call_format: "hermes" (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen's) or
        "plain" (``<tool_call>NAME ARGUMENTS</tool_call>``, the demo's).
    call_start, call_end: the text around a call; ``call_end`` (one token in the tokenizer) also stops a turn.
    result_role: the chat-template role of a tool's turn (its text comes from the tokenizer's template).
    timeout_s, max_result_chars: a call's time limit, and the longest result kept (longer ones are cut).
    max_workers: tool calls run at once.
    registry: {name: {kind: calculator | python | code, ...options}}; python: ``function`` =
        "pkg.module:function" called with the call's arguments; code: model-written Python run under
        bubblewrap (:class:`~megatron_zcpo.agent_tools.sandbox.CodeTool` lists its options: limits,
        ``network``, ``packages``, ``env``, ``isolation``; its own ``timeout_s`` bounds its calls: the
        registry waits for it past ``timeout_s`` here, so that no process of a call outlives the call).
    """

    enabled: bool = False
    max_turns: int = 4
    max_total_tokens: int = 4096
    call_format: str = "hermes"
    call_start: str = "<tool_call>"
    call_end: str = "</tool_call>"
    result_role: str = "tool"
    timeout_s: float = 10.0
    max_result_chars: int = 2000
    max_workers: int = 4
    registry: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"tools.max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 2:
            raise ValueError(f"tools.max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.call_format not in CALL_FORMATS:
            raise ValueError(f"tools.call_format must be one of {CALL_FORMATS}, got {self.call_format!r}")
        if self.timeout_s <= 0 or self.max_result_chars < 1 or self.max_workers < 1:
            raise ValueError("tools.timeout_s must be > 0, tools.max_result_chars and tools.max_workers >= 1")
        if self.enabled and not self.registry:
            raise ValueError("tools.enabled needs at least one tool in tools.registry")
        for name, spec in self.registry.items():
            if not isinstance(spec, dict) or spec.get("kind") not in TOOL_KINDS:
                raise ValueError(f"tools.registry.{name}.kind must be one of {TOOL_KINDS}, got {spec!r}")
            if spec["kind"] == "python" and ":" not in str(spec.get("function", "")):
                raise ValueError(f"tools.registry.{name}.function must be 'pkg.module:function'")
