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


def worked_steps(expression: str) -> List[str]:
    """The scratchpad of a left-to-right chain of integer additions and subtractions, one step a line.

    ``"4 - 1 - 7"`` -> ``["4-1=3", "3-7=-4"]``: each step applies the next operator to the running
    result (so the last step's right side is the expression's value). ``expression`` is
    reasoning-gym's ``chain_sum`` / ``basic_arithmetic`` metadata: non-negative integer terms and
    ``+`` / ``-`` separated by single spaces, at least two terms. Raises DataError otherwise.
    """
    parts = expression.split(" ")
    terms, operators = parts[0::2], parts[1::2]
    if (
        len(terms) < 2
        or len(terms) != len(operators) + 1
        or not all(t.isdigit() for t in terms)
        or not all(op in ("+", "-") for op in operators)
    ):
        raise DataError(f"worked steps need a chain of integers joined by ' + ' or ' - ', got {expression!r}")
    steps, total = [], int(terms[0])
    for operator, term in zip(operators, terms[1:]):
        result = total + int(term) if operator == "+" else total - int(term)
        steps.append(f"{total}{operator}{term}={result}")
        total = result
    return steps
