"""Procedural, offline, seeded prompt records from reasoning-gym tasks (for tests and the CPU demo)."""

from __future__ import annotations

from typing import Any, List

from megatron_zcpo.data.records import DataError, PromptRecord

# The default reward reads the last \boxed{} answer, so the question asks for one.
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."


def reasoning_gym_records(
    task: str, size: int, seed: int, instruction: str = BOXED_INSTRUCTION, **task_options: Any
) -> List[PromptRecord]:
    """Generate ``size`` records of the reasoning-gym task ``task`` (e.g. "basic_arithmetic", "chain_sum").

    The same ``(task, size, seed, task_options)`` always gives the same records. Each record has one
    user message (the task's question, then ``instruction`` on a new line when non-empty), the task's
    answer string (e.g. "-4", which math-verify checks), data_source ``"reasoning_gym/<task>"``, the
    task's metadata as extra_info and uid ``"reasoning_gym/<task>:<index>"``.
    ``task_options`` go to the task's config (e.g. ``min_terms=2, max_terms=2, min_digits=1, max_digits=1``).
    """
    import reasoning_gym  # imported on use: it loads every task module

    if size < 1:
        raise DataError(f"reasoning-gym task {task!r}: size must be >= 1, got {size}")
    if task not in reasoning_gym.factory.DATASETS:
        known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
        raise DataError(f"unknown reasoning-gym task {task!r}; known tasks: {known}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_options)
    except (TypeError, ValueError, AssertionError) as error:
        raise DataError(f"reasoning-gym task {task!r}: bad task options {task_options}: {error}") from error
    source = f"reasoning_gym/{task}"
    records = []
    for index, entry in enumerate(dataset):
        question = f"{entry['question']}\n{instruction}" if instruction else entry["question"]
        records.append(
            PromptRecord(
                uid=f"{source}:{index}",
                messages=[{"role": "user", "content": question}],
                answer=str(entry["answer"]),
                data_source=source,
                extra_info=dict(entry["metadata"]),
            )
        )
    return records
