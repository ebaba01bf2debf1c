"""Start-up checks of ``zcpo train``: what would fail late is tried once before any process is launched."""

from __future__ import annotations

import math
from typing import Any, List, Optional

from megatron_zcpo.utils.config_loader import ConfigError


class StartupCheckError(ConfigError):
    """A file, directory or function the run needs is missing or broken; the message names the key."""


def _check(problems: List[str], key: str, action) -> Any:
    """Run ``action()``; on failure record "key: error" in ``problems`` and return None."""
    try:
        return action()
    except Exception as error:
        problems.append(f"{key}: {type(error).__name__}: {error}")
        return None


def check_reward_function(function_path: str, record) -> float:
    """Import ``reward.function`` and call it once as the scorer does, on ``record``'s answer.

    ``record``: a :class:`~megatron_zcpo.data.records.PromptRecord`. Returns the value; raises
    ``TypeError`` naming the expected signature when the call does not fit or the result is not a
    finite number (the import error of an unimportable module propagates).
    """
    from megatron_zcpo.rewards.pool import resolve_function

    function = resolve_function(function_path)
    metadata = {"uid": record.uid, "data_source": record.data_source, "extra_info": record.extra_info}
    try:
        value = function(record.answer, record.answer, metadata)
    except TypeError as error:
        raise TypeError(
            f"calling {function_path}(response, ground_truth, metadata) failed: {error}; reward "
            "functions are called as fn(response: str, ground_truth: str, metadata: dict) -> float"
        ) from error
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{function_path} returned {value!r} for the first training record; expected a finite number")
    return float(value)


def run_startup_checks(
    config, *, world_size: Optional[int] = None, overwrite: bool = False, memory_check: bool = True
) -> None:
    """Check a validated :class:`~megatron_zcpo.recipe.config.RunConfig` against the file system,
    before any training process starts (:func:`startup_problems`), then open the run.

    Raises :class:`StartupCheckError` listing every problem found, each under its config key.
    When everything passes, opens the run (:func:`~megatron_zcpo.recipe.run_dir.open_run`): a run
    directory holding another run is refused unless ``overwrite``, the checkpoint to resume is
    checked (a damaged one is named and the newest intact one used) and the run id recorded.
    """
    import sys

    from megatron_zcpo.checkpoint.manifest import CheckpointDamagedError
    from megatron_zcpo.recipe.run_dir import RunMixError, open_run

    problems = startup_problems(config, world_size=world_size, memory_check=memory_check)
    if problems:
        raise StartupCheckError("start-up checks failed:\n  " + "\n  ".join(problems))
    try:
        open_run(config, lambda message: print(f"zcpo train: warning: {message}", file=sys.stderr), overwrite=overwrite)
    except RunMixError as refusal:
        raise StartupCheckError(str(refusal)) from None
    except CheckpointDamagedError as damaged:  # the checkpoint named by checkpoint.resume=PATH
        raise StartupCheckError(f"checkpoint.resume={config.checkpoint.resume}: {damaged}") from None


def startup_problems(config, *, world_size: Optional[int] = None, memory_check: bool = True) -> List[str]:
    """Every problem of a validated run config a process would meet at start-up, each under its key;
    [] when none. Writes nothing (``zcpo train --dry-run`` runs it as it is).

    Loads the tokenizer, the model's config, the training (and evaluation) data; imports the
    reward function and calls it once on the first record; with ``tools.enabled``, builds every
    tool, runs one call of each code tool in its sandbox and renders the tool turn; checks the layout on ``world_size``
    processes (default: one model-parallel replica) as a rank would (:func:`~megatron_zcpo.recipe.layout_checks.layout_problems`; memory
    against this node's GPU when it has one and ``memory_check``); probes that the run and
    checkpoint directories can be written. Cheap (no model weights are read, no GPU is touched).
    """
    from megatron_zcpo.checkpoint.io import check_checkpoint_dir
    from megatron_zcpo.data.dataset import load_records
    from megatron_zcpo.recipe.inputs import load_tokenizer
    from megatron_zcpo.recipe.layout_checks import layout_problems, run_architecture
    from megatron_zcpo.utils.devices import gpu_memory_gib

    problems: List[str] = []
    parallel = config.parallel
    world_size = world_size or parallel.tensor * parallel.pipeline * parallel.context
    tokenizer = _check(
        problems, "model.tokenizer" if config.model.tokenizer else "model.path", lambda: load_tokenizer(config)
    )
    model = _check(problems, "model.path", lambda: run_architecture(config))
    if config.model.reference is not None:
        from megatron_zcpo.convert.checkpoint import model_config_at

        _check(problems, "model.reference", lambda: model_config_at(config.model.reference))
    records = _check(
        problems, "data.train_files" if config.data.train_files else "data.task", lambda: load_records(config.data)
    )
    if records == []:  # (an empty data file is refused by name when it is read)
        problems.append(
            f"data.task={config.data.task!r}: the task produced no records (data.task_size, data.task_options)"
        )
    if config.eval.data is not None:
        _check(problems, "eval.data", lambda: load_records(config.eval.data))
    if records:
        _check(problems, "reward.function", lambda: check_reward_function(config.reward.function, records[0]))
    if model is not None:
        layout = layout_problems(
            config,
            model,
            world_size,
            world_source="processes (--nproc, or the job's tasks)",
            tokenizer_size=len(tokenizer) if tokenizer is not None else None,
            gpu_memory_gib=gpu_memory_gib() if memory_check else None,
        )
        problems += layout
        if not any(problem.startswith(("parallel.expert", "parallel.tensor")) for problem in layout):
            problems += _trainer_expert_problems(config, model)
    if config.tools.enabled:  # a code tool without its isolation (bubblewrap) is refused here, by name
        from megatron_zcpo.agent_tools.registry import tool_problems
        from megatron_zcpo.rollout.multi_turn import ToolTurnTemplate, check_text_tokenisation

        problems += tool_problems(config.tools)
        if tokenizer is not None:
            data, role = config.data, config.tools.result_role
            _check(
                problems,
                "tools.result_role",
                lambda: ToolTurnTemplate.from_chat_template(tokenizer, role, data.chat_template, data.enable_thinking),
            )
            _check(problems, "model.tokenizer", lambda: check_text_tokenisation(tokenizer))
    _check(problems, "logging.run_dir", lambda: check_checkpoint_dir(config.logging.run_dir))
    _check(problems, "checkpoint.dir", lambda: check_checkpoint_dir(config.checkpoint_dir))
    return problems


def _trainer_expert_problems(config, model) -> List[str]:
    """What the trainer refuses about routing replay, diagnostics and recompute on ``model``
    (:func:`~megatron_zcpo.training.config.check_experts`)."""
    from megatron_zcpo.training.config import check_experts

    try:
        check_experts(model, config.parallel, config.train, config.diagnostics.enabled)
    except ValueError as error:
        return [str(error)]
    return []
