"""Algorithms chosen by name: per-rollout coefficients and the per-micro-batch loss the trainer calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import group_advantages
from megatron_zcpo.algorithms.baselines import gvpo_loss, rpg_loss
from megatron_zcpo.algorithms.config import AlgorithmConfig
from megatron_zcpo.algorithms.groups import float_dtype
from megatron_zcpo.algorithms.kl import KL_ESTIMATORS, kl_penalty, masked_gradient_norm_ratio
from megatron_zcpo.algorithms.metrics import coefficient_metrics
from megatron_zcpo.algorithms.response_stats import ResponseStats
from megatron_zcpo.algorithms.surrogates import (
    Normalizer,
    PolicyLossOutput,
    aggregation_weights,
    check_token_tensors,
    loss_normalizer,
    policy_loss,
    weighted_sum,
)
from megatron_zcpo.algorithms.zcpo import drift_metrics, response_drift, zcpo_coefficients


def _preset_filled(value: Optional[str], key: str) -> str:
    """A preset-dependent switch of a resolved config (AlgorithmConfig.resolved() fills every None)."""
    if value is None:
        raise ValueError(f"algorithm.{key} is unset: build the algorithm from AlgorithmConfig.resolved()")
    return value


@dataclass
class AlgorithmLoss:
    """One micro-batch's loss (scalar, differentiable), detached 0-dim metrics and the clip gate [N, T].

    ``summed_metrics`` names the metrics that are partial sums (loss terms under the global
    normaliser: they add up over micro-batches and data-parallel ranks to the mini-batch's value);
    every other metric is a per-token fraction, averaged over tokens.
    """

    loss: Tensor
    metrics: Dict[str, Tensor] = field(default_factory=dict)
    clip_gate: Optional[Tensor] = None
    summed_metrics: Tuple[str, ...] = ()


class Algorithm:
    """Base of the registered algorithms.

    Per rollout the trainer calls ``coefficients(stats)`` once over the whole rollout; per
    micro-batch it calls ``loss(...)`` with the frozen coefficients of its rows and
    ``normalizer`` = the sum over the mini-batch's micro-batches and data-parallel ranks of
    ``normalizer_count(mask)``. Flags tell the trainer what to prepare: ``needs_reference``
    (reference log-probs / logits), ``required_stats`` (ResponseStats fields),
    ``needs_current_kl`` (differentiable conditional KL in loss), ``needs_whole_groups`` (every
    group inside one micro-batch), ``supports_token_weight`` (an importance weight per token).
    """

    needs_whole_groups = False
    supports_token_weight = True

    def __init__(self, config: AlgorithmConfig):
        self.config = config.resolved()

    @property
    def needs_current_kl(self) -> bool:
        """Whether loss() needs the differentiable conditional KL [N, T]."""
        return False

    @property
    def token_separable(self) -> bool:
        """See ClippedSurrogateAlgorithm.token_separable."""
        return False

    @property
    def reward_norm(self) -> str:
        """``config.reward_norm`` with the algorithm's preset filled in."""
        return _preset_filled(self.config.reward_norm, "reward_norm")

    @property
    def kl_loss(self) -> str:
        """``config.kl_loss`` with the algorithm's preset filled in."""
        return _preset_filled(self.config.kl_loss, "kl_loss")

    @property
    def name(self) -> str:
        """The registered name (config.name)."""
        return self.config.name

    @property
    def needs_reference(self) -> bool:
        """Whether the reference policy's log-probs (or logits) are needed at all."""
        raise NotImplementedError

    @property
    def required_stats(self) -> tuple:
        """The optional ResponseStats fields ``coefficients`` needs."""
        return ()

    @property
    def normalizer_unit(self) -> str:
        """'tokens' (token-mean) or 'sequences' (rows with >= 1 token): what ``normalizer`` counts."""
        return "tokens" if self.config.agg == "token-mean" else "sequences"

    def normalizer_count(self, mask: Tensor) -> Tensor:
        """This micro-batch's share [0-dim int64] of the global normaliser, from its mask [N, T]."""
        return loss_normalizer(mask, "token-mean" if self.normalizer_unit == "tokens" else "seq-mean-token-sum")

    def coefficients(self, stats: ResponseStats) -> Tensor:
        """Detached per-response coefficients [N] of a whole rollout, computed once at the snapshot.

        Responses with length 0 are left out of their group (no tokens to train, no drift) and
        get 0. float32, or float64 when rewards are float64.
        """
        stats.validate(self.required_stats)
        nonempty = stats.lengths > 0
        result = torch.zeros(stats.rewards.shape, dtype=float_dtype(stats.rewards), device=stats.rewards.device)
        result[nonempty] = self._coefficients(stats.rows(nonempty)).to(result.dtype)
        return result

    def coefficient_metrics(self, stats: ResponseStats, coefficients: Tensor) -> Dict[str, float]:
        """Scalars describing one rollout's coefficients [N] (``coefficients(stats)``), over its
        non-empty responses: the shared ones of :func:`megatron_zcpo.algorithms.metrics.coefficient_metrics`
        plus this algorithm's own (ZCPO: the drift's scale). {} when every response is empty."""
        nonempty = stats.lengths > 0
        kept = stats.rows(nonempty)
        metrics = coefficient_metrics(kept, coefficients[nonempty])
        if metrics:
            metrics.update(self._coefficient_metrics(kept))
        return metrics

    def _coefficient_metrics(self, stats: ResponseStats) -> Dict[str, float]:
        """This algorithm's own per-rollout metrics of the non-empty responses ``stats`` (none by default)."""
        return {}

    def _coefficients(self, stats: ResponseStats) -> Tensor:
        """Group advantages (reward_norm) of non-empty responses; ZCPO and the KL-in-reward baselines override."""
        return group_advantages(stats.rewards, stats.group_ids, norm=self.reward_norm, eps=self.config.eps)

    def loss(
        self,
        logprob: Tensor,
        old_logprob: Tensor,
        mask: Tensor,
        coefficients: Tensor,
        *,
        normalizer: Normalizer,
        ref_logprob: Optional[Tensor] = None,
        current_kl: Optional[Tensor] = None,
        token_weight: Optional[Tensor] = None,
        group_ids: Optional[Tensor] = None,
    ) -> AlgorithmLoss:
        """The loss of one micro-batch.

        logprob: [N, T] current log-probs (requires grad); old_logprob, ref_logprob, mask: [N, T];
        coefficients: [N] frozen, from ``coefficients``; normalizer: global count (see class doc);
        current_kl: [N, T] differentiable conditional KL (only when ``needs_current_kl``);
        token_weight: [N, T] detached per-token factor on the surrogate; group_ids: [N] (only when
        ``needs_whole_groups``). Summing the losses of any split of a mini-batch (rows whole) gives
        the unsplit loss and gradient.
        """
        raise NotImplementedError

    def _check_inputs(
        self,
        ref_logprob: Optional[Tensor],
        current_kl: Optional[Tensor],
        token_weight: Optional[Tensor],
        group_ids: Optional[Tensor],
    ) -> None:
        if token_weight is not None and not self.supports_token_weight:
            raise ValueError(f"token_weight is not supported by algorithm {self.name!r}")
        if current_kl is not None and not self.needs_current_kl:
            raise ValueError(f"current_kl was given but algorithm {self.name!r} does not use it")
        if current_kl is None and self.needs_current_kl:
            raise ValueError(f"algorithm {self.name!r} (kl_loss='full') needs current_kl")
        if group_ids is None and self.needs_whole_groups:
            raise ValueError(f"algorithm {self.name!r} needs group_ids for the micro-batch rows")
        if ref_logprob is None and self._needs_ref_logprob_in_loss:
            raise ValueError(f"algorithm {self.name!r} needs ref_logprob in loss()")

    @property
    def _needs_ref_logprob_in_loss(self) -> bool:
        return False


class ClippedSurrogateAlgorithm(Algorithm):
    """A detached per-response coefficient in the clipped surrogate, plus the vanilla KL loss if any."""

    @property
    def needs_current_kl(self) -> bool:
        """True for kl_loss='full': loss() needs the differentiable conditional KL [N, T]."""
        return self.config.kl_loss == "full"

    @property
    def token_separable(self) -> bool:
        """The loss is a sum of per-token terms over the global normaliser (no per-row token count,
        no batch-level rescaling), so a response's tokens may sit on different context-parallel ranks."""
        return self.config.agg != "seq-mean-token-mean" and self.config.f1_control != "match_masked_norm"

    @property
    def _needs_ref_logprob_in_loss(self) -> bool:
        return self.config.kl_loss in KL_ESTIMATORS

    def loss(
        self,
        logprob,
        old_logprob,
        mask,
        coefficients,
        *,
        normalizer,
        ref_logprob=None,
        current_kl=None,
        token_weight=None,
        group_ids=None,
    ) -> AlgorithmLoss:
        """policy_loss with the frozen coefficients, plus kl_coef * the KL loss if any (see Algorithm.loss).

        Metrics: policy_loss, clip_{low,high}_fraction, dual_clip_fraction, and with a KL loss
        kl_loss (the term added) and, for F1-C, kl_alpha.
        """
        self._check_inputs(ref_logprob, current_kl, token_weight, group_ids)
        config = self.config
        surrogate = policy_loss(
            logprob,
            old_logprob,
            coefficients,
            mask,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            clip_c=config.clip_c,
            agg=config.agg,
            normalizer=normalizer,
            token_weight=token_weight,
        )
        metrics = _surrogate_metrics(surrogate)
        loss = surrogate.loss
        if config.kl_loss != "none":
            kl_term = self.kl_loss_term(
                logprob, ref_logprob, current_kl, mask, surrogate.clip_gate, normalizer, metrics
            )
            loss = loss + kl_term
        return AlgorithmLoss(
            loss=loss, metrics=metrics, clip_gate=surrogate.clip_gate, summed_metrics=("policy_loss", "kl_loss")
        )

    def kl_loss_term(self, logprob, ref_logprob, current_kl, mask, clip_gate, normalizer, metrics) -> Tensor:
        """kl_coef * the aggregated per-token KL, masked (F1-B) or rescaled (F1-C) by the reward gate."""
        config = self.config
        if config.kl_loss == "full":
            check_token_tensors(mask, current_kl=current_kl)
            token_kl = current_kl
        else:
            check_token_tensors(mask, ref_logprob=ref_logprob)
            token_kl = kl_penalty(logprob, ref_logprob, self.kl_loss)
        weights = aggregation_weights(mask, config.agg, token_kl.dtype)
        if config.f1_control == "mask_clipped":
            weights = weights * clip_gate.to(weights.dtype)
        scale = torch.as_tensor(config.kl_coef, dtype=token_kl.dtype, device=token_kl.device)
        if config.f1_control == "match_masked_norm":
            alpha = masked_gradient_norm_ratio(logprob, ref_logprob, self.kl_loss, weights, clip_gate)
            metrics["kl_alpha"] = alpha
            scale = scale * alpha.to(token_kl.dtype)
        kl_term = scale * weighted_sum(token_kl, weights, normalizer)
        metrics["kl_loss"] = kl_term.detach()
        return kl_term


class ZCPO(ClippedSurrogateAlgorithm):
    """Zero-Sum Calibrated Policy Optimization: calibrated coefficients in the clipped surrogate, no KL loss."""

    @property
    def needs_reference(self) -> bool:
        """Always: the drift (conditional KL or k1) is measured against the reference."""
        return True

    @property
    def required_stats(self) -> tuple:
        """kl_sum (drift='conditional_kl') or k1_sum (drift='k1')."""
        return ("kl_sum",) if self.config.drift == "conditional_kl" else ("k1_sum",)

    def _coefficients(self, stats: ResponseStats) -> Tensor:
        config = self.config
        drift = response_drift(stats, config.drift, config.length_normalize)
        return zcpo_coefficients(
            stats.rewards,
            drift,
            stats.group_ids,
            config.beta,
            reward_norm=self.reward_norm,
            center=config.center,
            gate=config.gate,
            eps=config.eps,
        )

    def _coefficient_metrics(self, stats: ResponseStats) -> Dict[str, float]:
        """drift_mean, drift_peak_mean, drift_peak_max (see :func:`megatron_zcpo.algorithms.zcpo.drift_metrics`)."""
        return drift_metrics(stats, self.config)


class GroupAdvantageAlgorithm(ClippedSurrogateAlgorithm):
    """The vanilla baselines (dapo, grpo): group advantages, optional KL in the reward or as a loss."""

    @property
    def needs_reference(self) -> bool:
        """When there is a KL loss or KL in the reward."""
        return self.config.kl_loss != "none" or self.config.kl_in_reward_coef > 0

    @property
    def required_stats(self) -> tuple:
        """k1_sum when the KL is in the reward."""
        return ("k1_sum",) if self.config.kl_in_reward_coef > 0 else ()

    def _coefficients(self, stats: ResponseStats) -> Tensor:
        rewards = stats.rewards.to(float_dtype(stats.rewards))
        if self.config.kl_in_reward_coef > 0:
            assert stats.k1_sum is not None  # in required_stats: coefficients() validated it
            rewards = rewards - self.config.kl_in_reward_coef * stats.k1_sum.to(rewards.dtype)
        return group_advantages(rewards, stats.group_ids, norm=self.reward_norm, eps=self.config.eps)


class RPG(Algorithm):
    """RPG-REINFORCE with the UFKL correction and RPG-style clip (see baselines.rpg_loss)."""

    @property
    def needs_reference(self) -> bool:
        """Only for rpg_reference='ref' (the default refreshes the reference to pi_old)."""
        return self.config.rpg_reference == "ref"

    @property
    def _needs_ref_logprob_in_loss(self) -> bool:
        return self.needs_reference

    def loss(
        self,
        logprob,
        old_logprob,
        mask,
        coefficients,
        *,
        normalizer,
        ref_logprob=None,
        current_kl=None,
        token_weight=None,
        group_ids=None,
    ) -> AlgorithmLoss:
        """rpg_loss with the frozen advantages (see Algorithm.loss); metrics as the clipped surrogates'."""
        self._check_inputs(ref_logprob, current_kl, token_weight, group_ids)
        config = self.config
        surrogate = rpg_loss(
            logprob,
            old_logprob,
            coefficients,
            mask,
            kl_coef=config.rpg_kl_coef,
            ref_logprob=ref_logprob if config.rpg_reference == "ref" else None,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            clip_c=config.clip_c,
            agg=config.agg,
            normalizer=normalizer,
            token_weight=token_weight,
        )
        return AlgorithmLoss(
            loss=surrogate.loss,
            metrics=_surrogate_metrics(surrogate),
            clip_gate=surrogate.clip_gate,
            summed_metrics=("policy_loss",),
        )


class GVPO(Algorithm):
    """GVPO's group-variance loss (see baselines.gvpo_loss); groups must be whole in a micro-batch."""

    needs_whole_groups = True
    supports_token_weight = False  # GVPO is off-policy by construction and takes no importance weights

    @property
    def needs_reference(self) -> bool:
        """Never: GVPO's KL is against the previous policy."""
        return False

    @property
    def normalizer_unit(self) -> str:
        """Always 'sequences': the loss is one term per response."""
        return "sequences"

    def loss(
        self,
        logprob,
        old_logprob,
        mask,
        coefficients,
        *,
        normalizer,
        ref_logprob=None,
        current_kl=None,
        token_weight=None,
        group_ids=None,
    ) -> AlgorithmLoss:
        """gvpo_loss over this micro-batch's whole groups (see Algorithm.loss); metric: policy_loss."""
        self._check_inputs(ref_logprob, current_kl, token_weight, group_ids)
        loss = gvpo_loss(
            logprob, old_logprob, coefficients, mask, group_ids, beta=self.config.gvpo_beta, normalizer=normalizer
        )
        return AlgorithmLoss(loss=loss, metrics={"policy_loss": loss.detach()}, summed_metrics=("policy_loss",))


def _surrogate_metrics(surrogate: PolicyLossOutput) -> Dict[str, Tensor]:
    return {
        "policy_loss": surrogate.loss.detach(),
        "clip_low_fraction": surrogate.clip_low_fraction.detach(),
        "clip_high_fraction": surrogate.clip_high_fraction.detach(),
        "dual_clip_fraction": surrogate.dual_clip_fraction.detach(),
    }


ALGORITHMS = {
    "zcpo": ZCPO,
    "dapo": GroupAdvantageAlgorithm,
    "grpo": GroupAdvantageAlgorithm,
    "rpg": RPG,
    "gvpo": GVPO,
}


def build_algorithm(config: Union[AlgorithmConfig, Mapping]) -> Algorithm:
    """The algorithm named by ``config.name``, with validated, preset-resolved switches.

    config: an AlgorithmConfig or the ``algorithm:`` mapping of a run config. Raises ValueError
    naming ``algorithm.<key>`` for unknown keys, bad values or contradictory switches.
    """
    if not isinstance(config, AlgorithmConfig):
        config = AlgorithmConfig.from_dict(config)
    config.validate()  # before the lookup, so an unknown name is reported as algorithm.name
    return ALGORITHMS[config.name](config)
