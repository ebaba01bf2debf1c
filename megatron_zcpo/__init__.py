"""megatron_zcpo: RL post-training of LLMs on megatron-core with ZCPO.

The public names of the package's outside interface (listed in ``_EXPORTS`` below) are importable from here. They load lazily, so that
``import megatron_zcpo`` stays light and never imports CUDA-only packages (Transformer Engine,
apex, SGLang); megatron-core itself is imported only by the names that need it.
"""

import importlib
import warnings as _warnings

# megatron-core announces its CPU fallbacks at import; on CPU machines they are expected.
_warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)( and Apex)? (is|are) not installed.*")
_warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # algorithm core (pure torch)
    "group_advantages": "megatron_zcpo.algorithms.advantages",
    "sequence_drift": "megatron_zcpo.algorithms.zcpo",
    "zcpo_coefficients": "megatron_zcpo.algorithms.zcpo",
    "kl_penalty": "megatron_zcpo.algorithms.kl",
    "policy_loss": "megatron_zcpo.algorithms.surrogates",
    "AlgorithmConfig": "megatron_zcpo.algorithms.config",
    "build_algorithm": "megatron_zcpo.algorithms.registry",
    "ResponseStats": "megatron_zcpo.algorithms.response_stats",
    # vocab-parallel token statistics
    "vocab_parallel_token_stats": "megatron_zcpo.ops.token_stats",
    "fused_token_stats": "megatron_zcpo.ops.token_stats",
    "TokenStats": "megatron_zcpo.ops.token_stats",
    "MASKED_LOGIT": "megatron_zcpo.ops.token_stats",
    # megatron-core integration
    "setup_megatron": "megatron_zcpo.megatron.initialize",
    "ModelConfig": "megatron_zcpo.megatron.model",
    "PolicyTrainer": "megatron_zcpo.training.trainer",
    "plan_memory": "megatron_zcpo.planning.planner",
    "suggest_layout": "megatron_zcpo.planning.planner",
    # rollouts, rewards, data
    "SamplingParams": "megatron_zcpo.rollout.engine",
    "Completion": "megatron_zcpo.rollout.engine",
    "RolloutEngine": "megatron_zcpo.rollout.engine",
    "EmbeddedEngine": "megatron_zcpo.rollout.embedded",
    "SGLangEngine": "megatron_zcpo.rollout.sglang.client",
    "RewardConfig": "megatron_zcpo.rewards.config",
    "RewardScorer": "megatron_zcpo.rewards.scorer",
    "dapo_math_reward": "megatron_zcpo.rewards.math",
    "DataConfig": "megatron_zcpo.data.config",
    "build_prompt_dataset": "megatron_zcpo.data.dataset",
    "sample_groups": "megatron_zcpo.rollout.dynamic_sampling",
    "evaluate": "megatron_zcpo.rollout.evaluation",
    # diagnostics
    "DiagnosticsConfig": "megatron_zcpo.diagnostics.config",
    "build_diagnostics": "megatron_zcpo.diagnostics.runner",
    # the run configuration
    "RunConfig": "megatron_zcpo.recipe.config",
    "load_run_config": "megatron_zcpo.recipe.config",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_zcpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
