"""Start-up checks of ``zcpo train``: what would fail late is tried once before any process is launched."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, List

from megatron_zcpo.utils.config_loader import ConfigError


class StartupCheckError(ConfigError):
    """A file, directory or function the run needs is missing or broken; the message names the key."""


def _check(problems: List[str], key: str, action) -> Any:
    """Run ``action()``; on failure record "key: error" in ``problems`` and return None."""
    try:
        return action()
    except Exception as error:  # noqa: BLE001 - every failure becomes a named start-up problem
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
        raise TypeError(f"calling {function_path}(response, ground_truth, metadata) failed: {error}; reward "
                        "functions are called as fn(response: str, ground_truth: str, metadata: dict) -> float") from error
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{function_path} returned {value!r} for the first training record; expected a finite number")
    return float(value)


def run_startup_checks(config) -> None:
    """Check a validated :class:`~megatron_zcpo.recipe.config.RunConfig` against the file system.

    Loads the tokenizer, the model's config, the training (and evaluation) data; imports the
    reward function and calls it once on the first record; probes that the run and checkpoint
    directories can be written and that ``checkpoint.resume`` names a complete checkpoint.
    Cheap (no model weights are read, no GPU is touched). Raises :class:`StartupCheckError`
    listing every problem found, each under its config key.
    """
    from megatron_zcpo.recipe.inputs import load_tokenizer
    from megatron_zcpo.convert.checkpoint import model_config_at
    from megatron_zcpo.data.dataset import load_records
    from megatron_zcpo.megatron.checkpoint import TRAINER_STATE, check_checkpoint_dir

    problems: List[str] = []
    _check(problems, "model.tokenizer" if config.model.tokenizer else "model.path", lambda: load_tokenizer(config))
    for key in ("path", "reference"):
        path = getattr(config.model, key)
        if path is not None:
            _check(problems, f"model.{key}", lambda path=path: model_config_at(path))
    records = _check(problems, "data", lambda: load_records(config.data))
    if records == []:
        problems.append("data: no records")
    if config.eval.data is not None:
        _check(problems, "eval.data", lambda: load_records(config.eval.data))
    if records:
        _check(problems, "reward.function", lambda: check_reward_function(config.reward.function, records[0]))
    _check(problems, "logging.run_dir", lambda: check_checkpoint_dir(config.logging.run_dir))
    _check(problems, "checkpoint.dir", lambda: check_checkpoint_dir(config.checkpoint_dir))
    resume = config.checkpoint.resume
    if resume not in ("auto", "never") and not (Path(resume) / TRAINER_STATE).is_file():
        problems.append(f"checkpoint.resume: {resume} is not a complete checkpoint (no {TRAINER_STATE})")
    if problems:
        raise StartupCheckError("start-up checks failed:\n  " + "\n  ".join(problems))
