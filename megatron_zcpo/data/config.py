"""The ``data:`` section of the run configuration."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from megatron_zcpo.data.procedural import BOXED_INSTRUCTION
from megatron_zcpo.data.records import ON_BAD_ROW_CHOICES

CHAT_TEMPLATE_CHOICES = ("auto", "plain")


@dataclasses.dataclass
class DataConfig:
    """Where training prompts come from and how they are prepared.

    train_files: ``.jsonl`` / ``.parquet`` files (DAPO-Math-17K or plain {prompt, answer} layout), or
    task: a reasoning-gym task name (exactly one of the two), with ``task_size`` records generated from
        ``seed``, ``task_options`` for the task's config and ``task_instruction`` appended to each question.
    max_prompt_length: prompts longer than this many tokens (after the chat template) are left out.
    chat_template: "auto" uses the tokenizer's chat template when it has one, else plain text;
        "plain" always uses plain text ("User: ...\\n\\nAssistant:").
    enable_thinking: null leaves the chat template's default; true / false is passed to the template
        as ``enable_thinking`` (Qwen3's hybrid template: false closes an empty ``<think></think>``
        block so the model answers without reasoning). Refused with a template that does not read it.
    system_prompt: when set, a system message put first in every prompt that has none (e.g. the
        description of the tools of a multi-turn run, ``tools:``).
    shuffle, seed: each epoch is a fresh permutation drawn from (seed, epoch).
    on_bad_row: "error" stops at start-up listing the bad rows (file:line); "skip" logs and drops them.
    """

    train_files: List[str] = dataclasses.field(default_factory=list)
    task: Optional[str] = None
    task_size: int = 10000
    task_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    task_instruction: str = BOXED_INSTRUCTION
    max_prompt_length: int = 2048
    chat_template: str = "auto"
    enable_thinking: Optional[bool] = None
    system_prompt: Optional[str] = None
    shuffle: bool = True
    seed: int = 1234
    on_bad_row: str = "error"

    def validate(self) -> DataConfig:
        """Raise ValueError naming every bad ``data.<key>``; returns self."""
        problems = []
        if bool(self.train_files) == bool(self.task):
            problems.append(
                f"exactly one of data.train_files and data.task must be set, got train_files={self.train_files!r} "
                f"and task={self.task!r}"
            )
        if not isinstance(self.train_files, (list, tuple)) or not all(isinstance(f, str) for f in self.train_files):
            problems.append(f"data.train_files must be a list of paths, got {self.train_files!r}")
        if not isinstance(self.task_size, int) or self.task_size < 1:
            problems.append(f"data.task_size must be an integer >= 1, got {self.task_size!r}")
        if not isinstance(self.task_options, dict):
            problems.append(f"data.task_options must be a mapping, got {self.task_options!r}")
        if not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1:
            problems.append(f"data.max_prompt_length must be an integer >= 1, got {self.max_prompt_length!r}")
        if self.chat_template not in CHAT_TEMPLATE_CHOICES:
            problems.append(
                f"data.chat_template must be one of {list(CHAT_TEMPLATE_CHOICES)}, got {self.chat_template!r}"
            )
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            problems.append(f"data.enable_thinking must be true, false or null, got {self.enable_thinking!r}")
        if self.enable_thinking is not None and self.chat_template == "plain":
            problems.append("data.enable_thinking is a chat-template option; data.chat_template='plain' has none")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            problems.append(f"data.system_prompt must be a string, got {self.system_prompt!r}")
        if not isinstance(self.seed, int):
            problems.append(f"data.seed must be an integer, got {self.seed!r}")
        if self.on_bad_row not in ON_BAD_ROW_CHOICES:
            problems.append(f"data.on_bad_row must be one of {list(ON_BAD_ROW_CHOICES)}, got {self.on_bad_row!r}")
        if problems:
            raise ValueError("invalid data config:\n  " + "\n  ".join(problems))
        return self
