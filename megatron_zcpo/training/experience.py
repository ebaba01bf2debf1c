"""The experience pass of a rollout step: per-token statistics at the sampling snapshot, calibration, self-check.

With the policy at pi_old = pi_theta, one pipeline pass of the policy and the frozen reference
together (:class:`PolicyWithReference`) gives per response token the old log-prob, the reference
log-prob, the entropy and the exact full-vocabulary conditional KL (the fused vocab-parallel op).
Calibration all-gathers per-response sums (never tokens) over data-parallel ranks and turns them
into the algorithm's frozen coefficients. Both are functions of explicit inputs: the model chunks,
the step's micro-batches, the token-statistics options, the algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

from megatron_zcpo.megatron.pipeline import ModelChunks, output_weight, run_schedule
from megatron_zcpo.training.batch import MicroBatch, RolloutSample, is_padding
from megatron_zcpo.training.metrics import MetricAccumulator
from megatron_zcpo.training.rollout_step import ResponseTokenStats
from megatron_zcpo.utils.devices import compute_device


@dataclass(frozen=True)
class TokenStatsOptions:
    """How the fused op scores response tokens: the true ``vocab_size`` (the model's, before
    megatron's padding), ``chunk_size`` (``train.kl_chunk_size``), the rollout's sampling
    ``temperature`` and the kernels' ``backend`` (``train.token_stats_backend``: auto, torch or triton)."""

    vocab_size: int
    chunk_size: int
    temperature: float
    backend: str = "auto"


def token_stats_on_shard(hidden, weight, targets, ref_hidden=None, ref_weight=None, *, options: TokenStatsOptions):
    """Fused vocab-parallel statistics over this rank's vocabulary shard (see megatron_zcpo.ops).

    hidden / ref_hidden: [R, H] response positions' final hidden states; weight / ref_weight:
    [V_local, H] output layers; targets: [R] token ids. Log-probs and entropy at the sampling
    temperature (the distribution the rollout drew from); the conditional KL between the
    models themselves (temperature 1). Returns the op's TokenStats, each field [R].
    """
    from megatron.core import parallel_state as ps

    from megatron_zcpo.ops import fused_token_stats

    return fused_token_stats(
        hidden,
        weight,
        targets,
        ref_hidden,
        ref_weight,
        group=ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None,
        vocab_size=options.vocab_size,
        chunk_size=options.chunk_size,
        temperature=options.temperature,
        kl_temperature=1.0,
        backend=options.backend,
    )


@torch.no_grad()
def run_experience(
    models: ModelChunks, micro_batches: List[MicroBatch], options: TokenStatsOptions
) -> Dict[int, ResponseTokenStats]:
    """Per-token statistics at the sampling snapshot of the samples in ``micro_batches`` (this rank's).

    One forward of the policy and the reference side by side per micro-batch (no grad; the
    reference is brought to the device for the pass when offloaded). Returns {sample index:
    ResponseTokenStats} on the last pipeline stage, {} elsewhere.
    """
    models.place_reference(on_device=True)
    model = models.with_reference()
    hidden_size = models.hidden_size
    results: Dict[int, ResponseTokenStats] = {}

    def forward_step(mb: MicroBatch, m):
        output = models.forward(m, mb, "experience")

        def loss_func(hidden_pair):
            if is_padding(mb):  # expert parallelism's filler: it only takes part in the all-to-alls
                return torch.zeros((), device=hidden_pair.device), {}
            positions = mb.response_positions
            flat = hidden_pair.reshape(-1, 2 * hidden_size).index_select(0, positions)
            hidden, ref_hidden = flat.split(hidden_size, dim=-1)
            targets = mb.targets.reshape(-1).index_select(0, positions)
            stats = token_stats_on_shard(
                hidden,
                output_weight(models.policy),
                targets,
                ref_hidden,
                output_weight(models.reference),
                options=options,
            )
            offset = 0
            for index, length in zip(mb.sample_indices, mb.response_lengths):
                span = slice(offset, offset + length)
                results[index] = ResponseTokenStats(
                    stats.logprob[span].float().cpu(),
                    stats.ref_logprob[span].float().cpu(),
                    stats.entropy[span].float().cpu(),
                    stats.kl[span].float().cpu(),
                    mb.response_token_index[span],
                )
                offset += length
            return torch.zeros((), device=hidden_pair.device), {}

        return output, loss_func

    model.eval()
    run_schedule(model, micro_batches, forward_step, forward_only=True)
    model.train()
    models.reference.eval()
    models.place_reference(on_device=False)
    return results


def calibrate(samples: Sequence[RolloutSample], experience: Dict[int, ResponseTokenStats], algorithm):
    """Per-response coefficients for the whole rollout, frozen until the next rollout (last pipeline stage).

    The per-response sums (conditional KL, k1) of every DP rank's samples are all-gathered
    over the data-parallel group (and summed over context-parallel ranks, which each hold a
    piece of every sequence); rewards, groups and lengths are known everywhere. ``algorithm``:
    the registry's Algorithm, whose ``coefficients`` turns them into C_i. Returns
    (coefficients [N] float32, ResponseStats). Collective over the DP x CP group.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_zcpo.algorithms import ResponseStats

    n = len(samples)
    sums = torch.zeros(n, 2, dtype=torch.float64)
    for index, stats in experience.items():
        sums[index, 0] = stats.kl.double().sum()
        sums[index, 1] = (stats.old_logprob.double() - stats.ref_logprob.double()).sum()
    sums = sums.to(compute_device())
    # Each sample lives on exactly one DP rank (zeros elsewhere), so a SUM is a gather.
    dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
    sums = sums.cpu()
    stats = ResponseStats(
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float64),
        lengths=torch.tensor([s.policy_length for s in samples], dtype=torch.float64),
        kl_sum=sums[:, 0],
        k1_sum=sums[:, 1],
    )
    return algorithm.coefficients(stats).float(), stats


def selfcheck(experience: Dict[int, ResponseTokenStats], tolerance: float) -> Dict[str, float]:
    """Step-0 check (as slime does): policy == reference must give KL 0 and equal log-probs.

    Raises RuntimeError with the measured values when either exceeds ``tolerance``
    (``train.selfcheck_tolerance``; negative disables the check). Collective (a MAX all-reduce).
    """
    import torch.distributed as dist

    worst = torch.zeros(2, dtype=torch.float64)
    for stats in experience.values():
        if stats.kl.numel():
            worst[0] = max(worst[0], stats.kl.abs().max().double())
            worst[1] = max(worst[1], (stats.old_logprob - stats.ref_logprob).abs().max().double())
    worst = worst.to(compute_device())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    kl_max, gap_max = worst.tolist()
    if tolerance >= 0 and (kl_max > tolerance or gap_max > tolerance):
        raise RuntimeError(
            f"step-0 self-check failed: with policy == reference the conditional KL should be 0 and the "
            f"log-probs equal, but max KL = {kl_max:.3e} and max |logprob - ref_logprob| = {gap_max:.3e} "
            f"(train.selfcheck_tolerance = {tolerance}); the two models do not compute the same thing"
        )
    return {"selfcheck/kl_max": kl_max, "selfcheck/logprob_gap_max": gap_max}


def policy_turn_of_tokens(mask: torch.Tensor) -> torch.Tensor:
    """Which policy turn (0, 1, ...) each response token belongs to, [T] -> [T] int64, from a multi-turn
    response mask [T] (1: the policy's token, 0: a tool's); a tool token counts with the turn before it."""
    policy = mask.long() > 0
    starts = policy.clone()
    starts[1:] &= ~policy[:-1]
    return (torch.cumsum(starts.long(), 0) - 1).clamp(min=0)


def experience_metrics(
    samples: Sequence[RolloutSample], experience: Dict[int, ResponseTokenStats], metrics: MetricAccumulator
) -> None:
    """Add this rank's token-level KL / entropy / k3 and the trainer-vs-rollout log-prob gap to ``metrics``."""
    from megatron_zcpo.algorithms import kl_penalty

    for index, stats in experience.items():
        n = stats.kl.numel()
        if n == 0:
            continue
        metrics.add("experience/kl", stats.kl.sum(), n)
        metrics.add_max("experience/kl_max", stats.kl.max())
        metrics.add("experience/k3", kl_penalty(stats.old_logprob, stats.ref_logprob, "k3").sum(), n)
        metrics.add("experience/entropy", stats.entropy.sum(), n)
        gap = (stats.old_logprob - stats.ref_logprob).abs()
        metrics.add("experience/logprob_ref_gap", gap.sum(), n)
        metrics.add_max("experience/logprob_ref_gap_max", gap.max())
        mask = samples[index].response_mask
        if mask is not None:  # multi-turn: the conditional KL and entropy of the policy's turns 1, 2, 3+
            turn = policy_turn_of_tokens(torch.as_tensor(mask))[stats.token_index].clamp(max=2)
            for k in range(int(turn.max()) + 1 if turn.numel() else 0):
                chosen = turn == k
                name = f"turn{k + 1}" if k < 2 else "turn3plus"
                metrics.add(f"experience/kl_{name}", stats.kl[chosen].sum(), int(chosen.sum()))
                metrics.add(f"experience/entropy_{name}", stats.entropy[chosen].sum(), int(chosen.sum()))
        rollout = samples[index].rollout_logprobs
        if rollout is not None and len(rollout) == len(samples[index].response_ids):
            rollout = torch.as_tensor(rollout, dtype=torch.float32)[stats.token_index]
            gap = (stats.old_logprob - rollout).abs()
            metrics.add("rollout/logprob_diff", gap.sum(), n)
            metrics.add_max("rollout/logprob_diff_max", gap.max())
