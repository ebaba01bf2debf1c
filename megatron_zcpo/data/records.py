"""Prompt records and their reading from JSONL or Parquet files (DAPO-Math-17K and plain {prompt, answer} layouts)."""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
from typing import Any, Dict, Iterator, List, Mapping, Tuple

logger = logging.getLogger(__name__)

ON_BAD_ROW_CHOICES = ("error", "skip")
ROLES = ("system", "user", "assistant")
# top-level keys with a meaning; any other key of a row is kept in extra_info
_LAYOUT_KEYS = ("prompt", "answer", "reward_model", "data_source", "extra_info")
_MAX_LISTED_BAD_ROWS = 20


class DataError(ValueError):
    """Bad data: names the file and line (or row) of the offending record."""


@dataclasses.dataclass
class PromptRecord:
    """One prompt with its verifiable answer.

    uid: where it came from ("file.jsonl:12" line 12, "file.parquet:7" row 7, "reasoning_gym/chain_sum:3").
    messages: the chat, a list of {"role", "content"} dicts (a plain-text prompt becomes one user message).
    answer: the ground truth the reward function checks responses against.
    data_source: dataset name (the row's data_source, else the file name without extension).
    extra_info: the row's extra_info plus any other top-level keys (e.g. DAPO's "ability").
    prompt_text, prompt_ids: the rendered prompt and its token ids, set by tokenize_records.
    """

    uid: str
    messages: List[Dict[str, str]]
    answer: str
    data_source: str = ""
    extra_info: Dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_text: str = ""
    prompt_ids: List[int] = dataclasses.field(default_factory=list)


def _messages_from_prompt(prompt: Any) -> List[Dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("'prompt' is empty")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"'prompt' must be a non-empty string or list of chat messages, got {type(prompt).__name__}")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise ValueError(f"'prompt[{i}]' must be a {{role, content}} object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"'prompt[{i}].role' must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"'prompt[{i}].content' must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return messages


def _answer_from_row(row: Mapping[str, Any]) -> str:
    if "reward_model" in row:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise ValueError("'reward_model' must be an object with a 'ground_truth' (DAPO layout)")
        answer, key = reward_model["ground_truth"], "reward_model.ground_truth"
    elif "answer" in row:
        answer, key = row["answer"], "answer"
    else:
        raise ValueError(
            "missing the answer: expected 'answer' (plain layout) or 'reward_model.ground_truth' (DAPO layout)"
        )
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"'{key}' must be a non-empty string or number, got {answer!r}")
    return answer


def record_from_row(row: Any, uid: str, default_data_source: str = "") -> PromptRecord:
    """Build a :class:`PromptRecord` from one row of either layout.

    DAPO-Math-17K layout: ``prompt`` (list of {role, content}), ``reward_model.ground_truth``,
    ``data_source``, ``ability``, ``extra_info``. Plain layout: ``prompt`` (string or message list) and
    ``answer`` (string or number). Raises ValueError saying what is wrong with the row.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    if "prompt" not in row:
        raise ValueError("missing key 'prompt'")
    messages = _messages_from_prompt(row["prompt"])
    answer = _answer_from_row(row)
    data_source = row.get("data_source") or default_data_source
    if not isinstance(data_source, str):
        raise ValueError(f"'data_source' must be a string, got {type(data_source).__name__}")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, Mapping):
        raise ValueError(f"'extra_info' must be an object, got {type(extra_info).__name__}")
    extra_info = {**extra_info, **{k: v for k, v in row.items() if k not in _LAYOUT_KEYS}}
    return PromptRecord(uid=uid, messages=messages, answer=answer, data_source=data_source, extra_info=extra_info)


def _jsonl_rows(path: str) -> Iterator[Tuple[str, int, Any]]:
    """(position label, line number, parsed row or the JSON error) for each non-blank line."""
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield "line", line_number, json.loads(line)
            except json.JSONDecodeError as error:
                yield "line", line_number, ValueError(f"invalid JSON: {error}")


def _parquet_rows(path: str) -> Iterator[Tuple[str, int, Any]]:
    """(position label, 1-based row number, row dict) for each Parquet row, read in batches."""
    import pyarrow.parquet  # only Parquet inputs need pyarrow

    row_number = 0
    for batch in pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            row_number += 1
            yield "row", row_number, row


def read_prompt_file(path: str, on_bad_row: str = "error") -> List[PromptRecord]:
    """Read prompt records from a ``.jsonl`` or ``.parquet`` file.

    Bad rows (invalid JSON, missing or mistyped keys) are reported with the file and line (JSONL) or
    row (Parquet) number: ``on_bad_row="error"`` raises :class:`DataError` listing them, ``"skip"``
    logs them and leaves them out. Record uids are ``"<file name>:<line or row>"``. A file without
    a single row (empty, or blank lines only) raises :class:`DataError` naming it.
    """
    if on_bad_row not in ON_BAD_ROW_CHOICES:
        raise ValueError(f"on_bad_row must be one of {list(ON_BAD_ROW_CHOICES)}, got {on_bad_row!r}")
    name = os.path.basename(path)
    stem, extension = os.path.splitext(name)
    readers = {".jsonl": _jsonl_rows, ".parquet": _parquet_rows}
    if extension not in readers:
        raise DataError(f"{path}: unsupported data file type {extension!r}; expected one of {sorted(readers)}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such data file")
    records, bad_rows = [], []
    for label, number, row in readers[extension](path):
        try:
            if isinstance(row, Exception):
                raise row
            records.append(record_from_row(row, uid=f"{name}:{number}", default_data_source=stem))
        except ValueError as error:
            bad_rows.append(f"{path}:{number} ({label} {number}): {error}")
    if bad_rows:
        listed = "\n  ".join(bad_rows[:_MAX_LISTED_BAD_ROWS])
        more = (
            f"\n  ... and {len(bad_rows) - _MAX_LISTED_BAD_ROWS} more" if len(bad_rows) > _MAX_LISTED_BAD_ROWS else ""
        )
        if on_bad_row == "error":
            raise DataError(f"{len(bad_rows)} bad row(s) in {path} (data.on_bad_row=error):\n  {listed}{more}")
        logger.warning("skipped %d bad row(s) in %s (data.on_bad_row=skip):\n  %s%s", len(bad_rows), path, listed, more)
    if not records and not bad_rows:
        raise DataError(f"{path}: the file holds no records (it is empty or only blank lines)")
    return records
