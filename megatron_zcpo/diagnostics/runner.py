"""The KL failure-mode diagnostics F1-F7 as PolicyTrainer's ``diagnostics`` hook: definitions, passes, costs.

Every family is defined for the vanilla path (dapo / grpo with an independent KL loss k1 / k2 / k3
/ full, or KL in the reward) and for ZCPO through the reward / KL branch split of
:mod:`megatron_zcpo.diagnostics.branches`. "Pass" below is one extra forward-backward through
:func:`megatron_zcpo.training.update.gradient_vector` over the named samples (gradients never
reach the optimizer). The hook runs on the trainer's PolicyUpdate (models, optimizer, algorithm
and its loss, this rank's place) and the step's RolloutStep, never on the trainer itself.
A single-token pass costs one sequence's forward-backward on every data-parallel rank; the group
and mini-batch passes hold two flat fp32 gradient vectors of the rank's parameters at a time.
Metric names are ``diag/<name>``; undefined values (0 / 0) are NaN.

grad_share (2 passes over the first mini-batch, the paper's appendix C): g_R = gradient of the
  reward branch, g_K = gradient of the KL branch (skipped, 0, when the reference is not in the
  loss). grad_reward_norm, grad_kl_norm, grad_cosine = cos(g_R, g_K), grad_kl_share =
  ||g_K|| / ||g_R + g_K||. Also run (and reported) when f2 or f3 is on, which use them.
f1 (1 pass over the last mini-batch, +2 when a gate is closed; see :meth:`KLDiagnostics.before_minibatch`):
  closed tokens = trainable tokens whose reward gate (the training coefficients' clip gate under
  the current ratio) is closed. f1_closed_tokens, f1_closed_fraction, f1_kl_grad_norm = ||g_K||
  of that mini-batch, f1_kl_share_closed = ||g_K restricted to closed tokens|| / ||g_K||,
  f1_kl_overallocation = that share / the closed fraction,
  f1_direct_grad_closed_norm = ||gradient of the training loss restricted to closed
  tokens||: the KL loss's for vanilla, exactly 0 for ZCPO (its only term is the pinned surrogate).
  At the sampling snapshot (the first mini-batch) every ratio is 1 and no gate is closed.
f2 (cancellation_tokens single-token passes, + groups x (2 + tokens_per_group) passes shared with
  f5): u_t = token t's share of the reward-branch gradient. f2_cancellation = 1 - ||sum_t u_t|| /
  sum_t ||u_t|| over the first mini-batch, the denominator estimated as (its trainable token
  count) x (mean ||u_t|| over a uniform token sample). The same estimator per sampled group
  (reward-active groups, uniform) gives c_R,q; with s_q = ||g_K,q|| / ||g_R,q + g_K,q|| the KL
  share of group q: f2_group_cancellation_mean, f2_kl_share_low_cancellation /
  f2_kl_share_high_cancellation = median s_q over the ceil(n/10) sampled groups of lowest /
  highest c_R,q.
f3 (1 pass over the first mini-batch's identical-reward groups, none when it has none):
  f3_tied_group_fraction = groups whose rewards all tie (ZCPO's gate B_q = 0);
  f3_tied_grad_norm = ||gradient of the training loss restricted to those groups|| (vanilla: the
  KL loss alone; ZCPO: 0, or -beta*K_i's with gate off), f3_tied_grad_share = that / ||g_R + g_K||.
f4 (no pass; one all-reduce of [N] floats for a vanilla KL loss): over trainable non-empty
  responses, f4_corr_length_kl_sum = Pearson(T_i, D_i = sum_t kappa_{i,t}) and
  f4_corr_length_penalty = Pearson(T_i, P_i) with P_i the response's KL pressure in the method's
  own units: vanilla with a KL loss, its aggregated per-response total sum_t w_t k_t at the
  snapshot; otherwise the reference part of the coefficient, -(C_i - a_i) (ZCPO: beta * K_i).
f5 (groups x 2 passes, shared with f2): f5_kl_share_short / f5_kl_share_long = median s_q over
  the ceil(n/10) sampled groups with the shortest / longest mean response length.
f6 (no pass; 35 all-reduces of a few floats, 31 of them bisecting the top-p% thresholds): over
  all response tokens of the rollout, of the conditional KL kappa at the snapshot (the drift
  itself, comparable across methods):
  f6_kl_top<p>pct_share = share of sum kappa carried by the top p% tokens (exact),
  f6_kl_pos_<a>_<b> = mean kappa over response positions [a, b), f6_first_token_kl = mean kappa
  of the first response token, f6_first_token_share = its share of sum kappa,
  f6_head<n>_var_share = share of Var(K) carried by the first n = head_tokens response tokens
  (the paper's "first 10 tokens", diagnostics/drift.py head_variance_share).
f7 (no pass), on the paper's K (length-normalised, group-centred drift; diagnostics/drift.py), over
  the responses of reward-active groups: f7_k1_negative_fraction = responses whose summed k1 drift
  sum_t (old - ref) is negative before centring; f7_k1_drift_rmse = RMSE between K^k1 and K^kappa
  (a ZCPO coefficient's residual is beta times it); f7_noise_reference_scale = the small-KL
  sampling-noise scale of a length-normalised k1 drift, f7_k1_dispersion_ratio /
  f7_kappa_dispersion_ratio = within-group dispersion of K^k1 / K^kappa relative to it (Fig. 3g);
  f7_gvpo_noise_rms = GVPO's centred sampled log-ratio term minus its conditional expectation,
  times algorithm.gvpo_beta (Fig. 4b).
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Union

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import active_groups
from megatron_zcpo.algorithms.config import AlgorithmConfig
from megatron_zcpo.algorithms.groups import Groups
from megatron_zcpo.algorithms.kl import kl_penalty
from megatron_zcpo.algorithms.zcpo import sequence_drift
from megatron_zcpo.diagnostics.branches import BranchSplit, has_kl_branch
from megatron_zcpo.diagnostics.config import BRANCH_ALGORITHMS, DiagnosticsConfig
from megatron_zcpo.diagnostics.drift import drift_dispersion, gvpo_noise_rms, head_variance_share, k1_drift_rmse
from megatron_zcpo.diagnostics.probes import GradientProbe, sample_groups, trainable_tokens, uniform_tokens
from megatron_zcpo.diagnostics.statistics import (
    BranchGeometry,
    branch_geometry,
    cancellation_rate,
    decile_medians,
    pearson,
    position_profile,
    top_shares,
)
from megatron_zcpo.training.rollout_step import RolloutStep
from megatron_zcpo.training.update import PolicyUpdate, gradient_dot
from megatron_zcpo.utils.devices import compute_device

Metrics = Dict[str, Union[float, Tensor]]  # 0-dim tensors or floats; floats once shared


class _Rollout:
    """One diagnosed rollout step: the hook's arguments plus the derived split, probe and reductions."""

    def __init__(self, config: DiagnosticsConfig, update: PolicyUpdate, step: RolloutStep):
        self.update, self.samples = update, step.samples
        self.experience, self.stats = step.experience, step.stats
        stats = step.stats
        self.algorithm = update.algorithm.config
        config.check_algorithm(self.algorithm)
        # stats exist on the last pipeline stage only; the losses below run only there
        self.split = (
            BranchSplit(update.algorithm, stats)
            if stats is not None and self.algorithm.name in BRANCH_ALGORITHMS
            else None
        )
        self.probe = GradientProbe(update, step)
        # one replica of each value: TP ranks and non-last stages add nothing
        self.contributes = update.reports_metrics
        self.primary = update.reports_metrics and update.dp_rank == 0
        self.generator = torch.Generator().manual_seed(hash((config.seed, step.index)) % (2**63))
        self.has_kl = has_kl_branch(self.algorithm)
        self.kl_uses_reference = update.algorithm.needs_current_kl

    def reduce(self, tensor: Tensor) -> Tensor:
        """Sum of ``tensor`` over the contributing ranks, on every rank (collective, float64)."""
        import torch.distributed as dist

        tensor = tensor.to(torch.float64)
        if not self.contributes:
            tensor = torch.zeros_like(tensor)
        tensor = tensor.to(compute_device())
        dist.all_reduce(tensor)
        return tensor.cpu()

    def reward_loss(self, inputs) -> Tensor:
        return self.split.reward_loss(inputs)

    def kl_loss(self, inputs) -> Tensor:
        return self.split.kl_loss(inputs)

    def direct_loss(self, inputs) -> Tensor:
        return self.update.loss(inputs).loss

    def branches(self, indices: List[int]) -> BranchGeometry:
        """BranchGeometry of g_R and g_K over samples ``indices`` (2 passes, 1 without a KL branch).

        Holds two flat fp32 gradient vectors of this rank's parameters at once (for <g_R, g_K>).
        """
        reward = self.probe.gradient(indices, self.reward_loss)
        kl = (
            self.probe.gradient(indices, self.kl_loss, use_reference=self.kl_uses_reference)
            if self.has_kl
            else torch.zeros_like(reward)
        )
        return branch_geometry(gradient_dot(reward, reward), gradient_dot(kl, kl), gradient_dot(reward, kl))

    def cancellation(self, indices: List[int], reward_norm: Tensor, count: int) -> Tensor:
        """c_R over the trainable tokens of ``indices`` from ``count`` sampled single-token passes."""
        tokens = uniform_tokens(self.samples, indices, count, self.generator)
        norms = torch.tensor(
            [self.probe.token_norm(int(i), int(t), self.reward_loss) for i, t in tokens], dtype=torch.float64
        )
        return cancellation_rate(reward_norm, norms, trainable_tokens(self.samples, indices).shape[0])


class KLDiagnostics:
    """PolicyTrainer's ``diagnostics`` hook running the enabled families of a DiagnosticsConfig.

    ``due(step)`` and ``run(...)`` are what the trainer calls between calibration and the update;
    ``before_minibatch(...)`` measures F1 under partly updated parameters (see its doc). Every
    method is collective and returns the same metrics on every rank. Definitions and costs: the
    module docstring.
    """

    def __init__(self, config: DiagnosticsConfig):
        config.validate()
        self.config = config
        self.families = set(config.families)

    def due(self, step: int) -> bool:
        """Whether diagnostics run at trainer step ``step`` (0-based: step % every == 0)."""
        return self.config.enabled and step % self.config.every == 0

    def run(self, update: PolicyUpdate, step: RolloutStep) -> Dict[str, float]:
        """Every enabled family but F1, between calibration and the update (see module doc).

        update: what the trainer's update runs with (PolicyTrainer.policy_update()); step: the
        RolloutStep as PolicyTrainer.train_step has it (experience, coefficients and stats on the
        last pipeline stage only). Collective.
        """
        rollout = _Rollout(self.config, update, step)
        families = self.families
        metrics: Metrics = {}
        first = step.assignment.minibatches[0]
        if families & {"grad_share", "f2", "f3"}:
            geometry = rollout.branches(first)
            metrics.update(
                grad_reward_norm=geometry.reward_norm,
                grad_kl_norm=geometry.kl_norm,
                grad_cosine=geometry.cosine,
                grad_kl_share=geometry.kl_share,
            )
            if "f2" in families:
                metrics["f2_cancellation"] = rollout.cancellation(
                    first, geometry.reward_norm, self.config.cancellation_tokens
                )
            if "f3" in families:
                metrics.update(_tied_groups(rollout, first, geometry.total_norm))
        if families & {"f2", "f5"}:
            metrics.update(_group_shares(rollout, self.config, families))
        if "f4" in families:
            metrics.update(_length_correlations(rollout))
        if "f6" in families:
            metrics.update(_concentration(rollout, self.config))
        if "f7" in families and rollout.primary:
            metrics.update(_sampling_noise(rollout))
        return _shared(metrics, rollout.primary)

    def before_minibatch(self, update: PolicyUpdate, step: RolloutStep, index: int) -> Dict[str, float]:
        """F1 on mini-batch ``index`` under the current parameters, when it is the rollout's last one.

        Meant to be called by the trainer on a due step just before the backward of each
        mini-batch (arguments as for :meth:`run`, plus ``index``): by the last mini-batch the
        previous updates have moved the ratios, so reward gates close. Returns {} for other
        mini-batches or when F1 is off. Collective.
        """
        minibatches = step.assignment.minibatches
        if "f1" not in self.families or index != len(minibatches) - 1:
            return {}
        rollout = _Rollout(self.config, update, step)
        return _shared(_clipped_tokens(rollout, minibatches[index]), rollout.primary)


def build_diagnostics(
    config: Union[DiagnosticsConfig, Mapping, None], algorithm: Optional[AlgorithmConfig] = None
) -> Optional[KLDiagnostics]:
    """The hook object for PolicyTrainer(diagnostics=...) from the ``diagnostics:`` section, or None when off.

    config: a DiagnosticsConfig or its mapping; algorithm: the run's algorithm config, checked
    against the branch families (ValueError naming ``diagnostics.families`` for rpg / gvpo).
    Raises ValueError naming ``diagnostics.<key>`` for bad values.
    """
    if config is None:
        return None
    if not isinstance(config, DiagnosticsConfig):
        from megatron_zcpo.utils.config_loader import from_dict

        config = from_dict(DiagnosticsConfig, config, prefix="diagnostics")
    config.validate()
    if algorithm is not None:
        config.check_algorithm(algorithm)
    return KLDiagnostics(config) if config.enabled else None


# ------------------------------------------------------------------------------------------ families


def _clipped_tokens(rollout: _Rollout, minibatch: List[int]) -> Metrics:
    """F1 on ``minibatch``: the KL branch pass counts closed gates; two restricted passes when any."""
    closed_count = 0.0

    def closed(inputs) -> Tensor:
        return (inputs.mask != 0) & ~rollout.split.reward_gate(inputs)

    def kl_counting_closed(inputs) -> Tensor:
        nonlocal closed_count
        closed_count += float(closed(inputs).sum())
        return rollout.kl_loss(inputs)

    kl = rollout.probe.gradient(minibatch, kl_counting_closed, use_reference=rollout.kl_uses_reference)
    kl_norm = rollout.probe.norm(kl)
    count = rollout.reduce(torch.tensor(closed_count))
    trainable = trainable_tokens(rollout.samples, minibatch).shape[0]
    fraction = count / trainable if trainable else math.nan
    metrics = {"f1_closed_tokens": count, "f1_closed_fraction": fraction, "f1_kl_grad_norm": kl_norm}
    if count > 0:
        kl_closed = rollout.probe.norm(
            rollout.probe.gradient(minibatch, rollout.kl_loss, select=closed, use_reference=rollout.kl_uses_reference)
        )
        direct_closed = rollout.probe.norm(
            rollout.probe.gradient(
                minibatch, rollout.direct_loss, select=closed, use_reference=rollout.kl_uses_reference
            )
        )
    else:
        kl_closed = direct_closed = 0.0
    share = kl_closed / kl_norm if kl_norm > 0 else math.nan
    metrics.update(
        f1_kl_share_closed=share,
        f1_kl_overallocation=share / fraction if count > 0 else math.nan,
        f1_direct_grad_closed_norm=direct_closed,
    )
    return metrics


def _tied_groups(rollout: _Rollout, first: List[int], total_norm: Tensor) -> Metrics:
    """F3: the fraction of identical-reward groups and the gradient the first mini-batch's ones carry."""
    samples = rollout.samples
    group_ids = torch.tensor([s.group_id for s in samples], dtype=torch.long)
    active = active_groups(torch.tensor([float(s.reward) for s in samples], dtype=torch.float64), group_ids)
    tied_fraction = float((1.0 - Groups.of(group_ids).max(active.to(torch.float64))).mean())
    tied = [i for i in first if not active[i] and trainable_tokens(samples, [i]).shape[0] > 0]
    norm = (
        rollout.probe.norm(rollout.probe.gradient(tied, rollout.direct_loss, use_reference=rollout.kl_uses_reference))
        if tied
        else 0.0
    )
    return {
        "f3_tied_group_fraction": tied_fraction,
        "f3_tied_grad_norm": norm,
        "f3_tied_grad_share": norm / total_norm if total_norm > 0 else math.nan,
    }


def _group_shares(rollout: _Rollout, config: DiagnosticsConfig, families: set) -> Metrics:
    """F2 / F5 per sampled group: KL share s_q, cancellation c_R,q (F2), deciles by c_R,q and by length."""
    groups = sample_groups(rollout.samples, config.groups, rollout.generator)
    shares, cancellations, lengths = [], [], []
    for indices in groups:
        geometry = rollout.branches(indices)
        shares.append(float(geometry.kl_share))
        lengths.append(sum(rollout.samples[i].policy_length for i in indices) / len(indices))
        if "f2" in families:
            cancellations.append(float(rollout.cancellation(indices, geometry.reward_norm, config.tokens_per_group)))
    shares = torch.tensor(shares, dtype=torch.float64)
    metrics = {}
    if "f2" in families:
        cancellations = torch.tensor(cancellations, dtype=torch.float64)
        low, high = decile_medians(shares, cancellations)
        metrics.update(
            f2_group_cancellation_mean=cancellations.nanmean() if cancellations.numel() else math.nan,
            f2_kl_share_low_cancellation=low,
            f2_kl_share_high_cancellation=high,
        )
    if "f5" in families:
        short, long = decile_medians(shares, torch.tensor(lengths, dtype=torch.float64))
        metrics.update(f5_kl_share_short=short, f5_kl_share_long=long)
    return metrics


def _length_correlations(rollout: _Rollout) -> Metrics:
    """F4: Pearson correlations of response length with the summed drift and with the KL pressure."""
    algorithm, samples = rollout.algorithm, rollout.samples
    penalty = None
    if algorithm.name in BRANCH_ALGORITHMS and algorithm.kl_loss != "none":
        totals = torch.zeros(len(samples), dtype=torch.float64)
        for index, token in rollout.experience.items():
            values = (
                token.kl
                if algorithm.kl_loss == "full"
                else kl_penalty(token.old_logprob, token.ref_logprob, algorithm.kl_loss)
            )
            if values.numel():
                totals[index] = sequence_drift(
                    values[None], torch.ones_like(values)[None], length_normalize=algorithm.agg == "seq-mean-token-mean"
                )[0]
        penalty = rollout.reduce(totals)  # each sample lives on one data-parallel rank: a sum is a gather
    if not rollout.primary:
        return {}
    if penalty is None and rollout.split is not None:
        penalty = -rollout.split.kl_coefficients
    stats = rollout.stats
    used = torch.tensor([s.trainable and s.policy_length > 0 for s in samples])
    metrics = {"f4_corr_length_kl_sum": pearson(stats.lengths[used], stats.kl_sum[used])}
    if penalty is not None:
        metrics["f4_corr_length_penalty"] = pearson(stats.lengths[used], penalty[used])
    return metrics


def _concentration(rollout: _Rollout, config: DiagnosticsConfig) -> Metrics:
    """F6: top-token shares, KL by position bucket and first-token drift of the conditional KL."""
    token_kl = (
        [rollout.experience[i].kl.to(torch.float64) for i in sorted(rollout.experience)] if rollout.contributes else []
    )
    token_kl = [values for values in token_kl if values.numel()]
    shares = top_shares(torch.cat(token_kl) if token_kl else torch.zeros(0), config.top_fractions, rollout.reduce)
    metrics = {f"f6_kl_top{100 * f:g}pct_share": share for f, share in zip(config.top_fractions, shares)}
    if token_kl:
        padded = torch.nn.utils.rnn.pad_sequence(token_kl, batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(v) for v in token_kl], batch_first=True)
        profiles = torch.cat(
            [position_profile(padded, mask, config.position_buckets), position_profile(padded, mask, [1])], dim=1
        )
    else:
        profiles = torch.zeros(2, len(config.position_buckets) + 3, dtype=torch.float64)
    sums, counts = rollout.reduce(profiles)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, math.nan))
    bounds = [0] + list(config.position_buckets) + ["inf"]
    for k, (low, high) in enumerate(zip(bounds, bounds[1:])):
        metrics[f"f6_kl_pos_{low}_{high}"] = means[k]
    first = len(config.position_buckets) + 1  # the [0, 1) bucket of the second profile
    metrics["f6_first_token_kl"] = means[first]
    total = sums[first] + sums[first + 1]
    metrics["f6_first_token_share"] = sums[first] / total if total > 0 else math.nan
    head = torch.zeros(len(rollout.samples), dtype=torch.float64)
    for index, token in rollout.experience.items() if rollout.contributes else ():
        head[index] = token.kl[: config.head_tokens].double().sum()
    head = rollout.reduce(head)  # each sample lives on one data-parallel rank: a sum is a gather
    if rollout.primary:
        metrics[f"f6_head{config.head_tokens}_var_share"] = head_variance_share(head, rollout.stats)
    return metrics


def _sampling_noise(rollout: _Rollout) -> Metrics:
    """F7 (primary rank): negative k1 drifts before centring; k1 vs conditional-KL K: RMSE, dispersions, GVPO's noise."""
    stats = rollout.stats
    nonempty = stats.lengths > 0
    dispersion = drift_dispersion(stats)
    return {
        "f7_k1_negative_fraction": (stats.k1_sum[nonempty] < 0).to(torch.float64).mean(),
        "f7_k1_drift_rmse": k1_drift_rmse(stats),
        "f7_noise_reference_scale": dispersion.reference_scale,
        "f7_k1_dispersion_ratio": dispersion.k1_ratio,
        "f7_kappa_dispersion_ratio": dispersion.kappa_ratio,
        "f7_gvpo_noise_rms": gvpo_noise_rms(stats, rollout.algorithm.gvpo_beta),
    }


def _shared(metrics: Metrics, primary: bool) -> Dict[str, float]:
    """The primary rank's metrics as ``diag/<name>`` floats on every rank (collective)."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {f"diag/{k}": float(v) for k, v in metrics.items()} if primary else None)
    return next(m for m in everyone if m is not None)
