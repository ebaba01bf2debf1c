"""Pure math (no process groups): advantages, ZCPO calibration, surrogates, KL estimators, comparison methods, registry."""

from megatron_zcpo.algorithms.advantages import active_groups, group_advantages
from megatron_zcpo.algorithms.baselines import gvpo_loss, rpg_loss
from megatron_zcpo.algorithms.config import AlgorithmConfig
from megatron_zcpo.algorithms.kl import kl_penalty
from megatron_zcpo.algorithms.registry import Algorithm, AlgorithmLoss, build_algorithm
from megatron_zcpo.algorithms.response_stats import ResponseStats
from megatron_zcpo.algorithms.surrogates import PolicyLossOutput, loss_normalizer, policy_loss
from megatron_zcpo.algorithms.zcpo import sequence_drift, zcpo_coefficients

__all__ = [
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmLoss",
    "PolicyLossOutput",
    "ResponseStats",
    "active_groups",
    "build_algorithm",
    "group_advantages",
    "gvpo_loss",
    "kl_penalty",
    "loss_normalizer",
    "policy_loss",
    "rpg_loss",
    "sequence_drift",
    "zcpo_coefficients",
]
