"""Evaluation in the recipe and in ``zcpo eval``: avg@k / pass@k of a policy on held-out prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from megatron_zcpo.recipe.config import RunConfig


def run_evaluation(config: RunConfig, engine, records, score, stop: tuple, output_path) -> Dict[str, float]:
    """avg@k / pass@k of ``engine`` on ``records`` with the ``eval:`` sampling; flat ``eval/...`` metrics."""
    from megatron_zcpo.rollout.engine import SamplingParams
    from megatron_zcpo.rollout.evaluation import evaluate

    ev = config.eval
    params = SamplingParams(
        temperature=ev.temperature,
        top_p=ev.top_p,
        max_new_tokens=ev.max_new_tokens or config.rollout.max_new_tokens,
        stop_token_ids=stop,
        seed=ev.seed,
    )
    result = evaluate(engine, records, score, params, k=ev.k, output_path=str(output_path))
    return {
        f"eval/{key}": float(value)
        for key, value in result.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def hf_weights(path: Path):
    """(ModelConfig, iterator of (hf_name, tensor)) of an HF directory or a Megatron checkpoint.

    Megatron checkpoints (converted, a training run's ``weights/``, or a training checkpoint
    ``step_*`` directory) are read one tensor at a time and converted on the fly.
    """
    from megatron_zcpo.convert.checkpoint import megatron_checkpoint_dir, model_config_at, read_checkpoint_tensors
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream

    model, checkpoint = model_config_at(path), megatron_checkpoint_dir(path)
    if checkpoint is not None:
        from megatron_zcpo.megatron.initialize import setup_megatron

        setup_megatron()
        return model, megatron_to_hf_stream(read_checkpoint_tensors(checkpoint, model), model)
    safetensors = SafetensorsCheckpoint(path)
    return model, ((name, safetensors.tensor(name)) for name in safetensors.names())


def evaluate_policy(config: RunConfig, checkpoint: Optional[str], output: Path) -> Dict[str, float]:
    """``zcpo eval``: the ``eval/...`` metrics of ``checkpoint`` (default ``model.path``) on the held-out data.

    Raises SystemExit when the config has no evaluation data.
    """
    from megatron_zcpo.recipe.inputs import eval_records, load_tokenizer
    from megatron_zcpo.recipe.rollout import make_engine, stop_token_ids
    from megatron_zcpo.rewards.scorer import RewardScorer

    tokenizer = load_tokenizer(config)
    model_config, weights = hf_weights(Path(checkpoint or config.model.path))
    records = eval_records(config, tokenizer)
    if not records:
        raise SystemExit("zcpo eval: no evaluation data: set eval.data (or use a procedural data.task)")
    with make_engine(config, model_config, tokenizer) as engine, RewardScorer(config.reward) as scorer:
        if config.rollout.engine == "embedded":
            engine.update_weights(weights, version=0)
        return run_evaluation(
            config,
            engine,
            records,
            lambda r, c: scorer.score_completions(r, c, tokenizer),
            stop_token_ids(config, tokenizer),
            output,
        )
