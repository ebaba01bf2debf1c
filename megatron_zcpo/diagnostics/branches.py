"""The reward / KL branch split of a clipped-surrogate algorithm's loss, and token-restricted losses.

Vanilla (dapo / grpo): the reward branch is the clipped surrogate with the reward advantages
(without any KL folded into the reward); the KL branch is what the reference adds: the KL loss
term (k1 / k2 / k3 / full, with its F1 control) and, with ``kl_in_reward_coef``, the surrogate with
the coefficients' KL part. ZCPO: the reward branch is the surrogate with a_i = A_i / s_q (the
coefficients at beta = 0), the KL branch the surrogate with C_i - a_i = -beta * K_i. Without
clipping the two branches add up to the training loss; with clipping each branch's gate follows
the sign of its own coefficient, so they need not.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from megatron_zcpo.algorithms.config import AlgorithmConfig
from megatron_zcpo.algorithms.registry import Algorithm, ResponseStats, build_algorithm
from megatron_zcpo.diagnostics.config import BRANCH_ALGORITHMS

# The switches that remove the reference from an algorithm, leaving its reward-only surrogate.
REFERENCE_OFF = {
    "zcpo": {"beta": 0.0},
    "dapo": {"kl_in_reward_coef": 0.0, "kl_loss": "none", "kl_coef": AlgorithmConfig.kl_coef, "f1_control": "none"},
    "grpo": {"kl_in_reward_coef": 0.0, "kl_loss": "none", "kl_coef": AlgorithmConfig.kl_coef, "f1_control": "none"},
}


def restrict(inputs, selection: Tensor):
    """The same LossInputs with gradients flowing only through the tokens where ``selection`` [b, T] is True.

    The loss values are unchanged (unselected log-probs and current KL are detached, not
    removed), so a loss of the restricted inputs has exactly the selected tokens' share of the
    full gradient: every loss here reaches the parameters only through per-token log-probs and
    conditional KLs.
    """

    def keep(tensor):
        return None if tensor is None else torch.where(selection, tensor, tensor.detach())

    return dataclasses.replace(inputs, logprob=keep(inputs.logprob), current_kl=keep(inputs.current_kl))


def has_kl_branch(config: AlgorithmConfig) -> bool:
    """Whether the reference enters ``config``'s loss at all (else the KL branch is identically 0)."""
    return (config.name == "zcpo" and config.beta > 0) or config.kl_loss != "none" or config.kl_in_reward_coef > 0


class BranchSplit:
    """The reward and KL branches of ``algorithm`` on one rollout (last pipeline stage; see module doc).

    stats: the rollout's ResponseStats [N]. reward_coefficients / kl_coefficients: [N] float64,
    the coefficients' reward part and reference part (C = reward + kl). ``surrogate`` is the
    algorithm with its reference switched off (its loss is the bare clipped surrogate).
    """

    def __init__(self, algorithm: Algorithm, stats: ResponseStats):
        name = algorithm.config.name
        if name not in BRANCH_ALGORITHMS:
            raise ValueError(
                f"the reward / KL branch split is defined for algorithm.name in {BRANCH_ALGORITHMS}, not {name!r}"
            )
        self.algorithm = algorithm
        self.surrogate = build_algorithm(dataclasses.replace(algorithm.config, **REFERENCE_OFF[name]))
        self.reward_coefficients = self.surrogate.coefficients(stats).to(torch.float64)
        self.kl_coefficients = algorithm.coefficients(stats).to(torch.float64) - self.reward_coefficients

    def reward_gate(self, inputs) -> Tensor:
        """[b, T] bool: tokens whose reward gradient is live (not clipped) under the training coefficients."""
        return self.surrogate.loss(
            inputs.logprob, inputs.old_logprob, inputs.mask, inputs.coefficients, normalizer=inputs.normalizer
        ).clip_gate

    def _surrogate_loss(self, inputs, coefficients: Tensor) -> Tensor:
        rows = torch.as_tensor(inputs.sample_indices, dtype=torch.long)
        coefficients = coefficients[rows].to(inputs.logprob.device)
        return self.surrogate.loss(
            inputs.logprob,
            inputs.old_logprob,
            inputs.mask,
            coefficients,
            normalizer=inputs.normalizer,
            token_weight=inputs.token_weight,
        ).loss

    def reward_loss(self, inputs) -> Tensor:
        """The reward branch's loss on one micro-batch's LossInputs (scalar)."""
        return self._surrogate_loss(inputs, self.reward_coefficients)

    def kl_loss(self, inputs) -> Tensor:
        """The KL branch's loss on one micro-batch's LossInputs (scalar).

        The KL loss term is the algorithm's own (its F1 control sees the training coefficients'
        clip gate; F1-C's alpha is measured per micro-batch, as in training).
        """
        loss = self._surrogate_loss(inputs, self.kl_coefficients)
        if self.algorithm.config.kl_loss == "none":
            return loss
        # the algorithm's KL term itself, so that the split can never drift from the trained loss
        kl_term = self.algorithm.kl_loss_term(
            inputs.logprob,
            inputs.ref_logprob,
            inputs.current_kl,
            inputs.mask,
            self.reward_gate(inputs),
            inputs.normalizer,
            {},
        )
        return loss + kl_term
