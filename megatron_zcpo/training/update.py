"""The update of a rollout step: loss inputs, importance weights, forward-backward, optimizer steps, gradient probes.

Per mini-batch, megatron-core's forward_backward_func runs over packed micro-batches with the
algorithm's loss on the step's frozen coefficients, exact token-mean normalisation across
micro-batches and DP ranks, then gradient clipping and one optimizer step. The gradient probes
(diagnostics) run the same forward-backward with a custom loss and never reach the optimizer.
Every function here runs on explicit inputs: the :class:`PolicyUpdate` (models, optimizer,
algorithm and its loss) and the :class:`~megatron_zcpo.training.rollout_step.RolloutStep`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import torch

from megatron_zcpo.megatron.pipeline import ModelChunks, output_weight, run_schedule
from megatron_zcpo.training.batch import MicroBatch, MicroBatchLayout, RolloutSample, collate_micro_batches, is_padding
from megatron_zcpo.training.config import ImportanceSamplingConfig
from megatron_zcpo.training.experience import TokenStatsOptions, token_stats_on_shard
from megatron_zcpo.training.metrics import MetricAccumulator
from megatron_zcpo.training.preemption import StopCheck, UpdateInterrupted, UpdateProgress, stop_if_asked
from megatron_zcpo.training.rollout_step import RolloutStep
from megatron_zcpo.utils.devices import compute_device


@dataclass
class LossInputs:
    """One micro-batch's loss inputs; token tensors are right-padded rows [b, T].

    ``logprob`` carries gradients to the policy (current parameters, sampling temperature);
    ``old_logprob``/``ref_logprob`` are from the experience pass; ``mask`` marks trainable
    response tokens; ``coefficients`` [b] are the rollout's frozen ones; ``normalizer`` is the
    global denominator of the mini-batch; ``current_kl`` (differentiable) only when the
    reference ran alongside; ``token_weight`` is the importance-sampling correction or None.
    """

    sample_indices: List[int]
    logprob: torch.Tensor
    old_logprob: torch.Tensor
    ref_logprob: torch.Tensor
    mask: torch.Tensor
    coefficients: torch.Tensor
    normalizer: float
    current_kl: Optional[torch.Tensor]
    token_weight: Optional[torch.Tensor]
    group_ids: torch.Tensor


@dataclass(frozen=True)
class PolicyUpdate:
    """What the update, the gradient probes and the diagnostics run with besides the rollout step.

    ``models``: this rank's model chunks; ``optimizer``: megatron-core's optimizer over the policy;
    ``algorithm``: the registry's Algorithm (its needs: current KL, whole groups, token weights,
    the normaliser's unit); ``loss``: LossInputs -> AlgorithmLoss (see :func:`algorithm_loss`);
    ``layout``: how this rank collates micro-batches (for a step without its own);
    ``token_stats``, ``importance_sampling``: how log-probs and weights are computed;
    ``dp_size`` / ``dp_rank``; ``reports_metrics``: this rank reports its replica's metrics;
    ``counts_once``: values every rank of a (DP x CP) replica knows whole are counted here;
    ``max_skipped_steps``: consecutive skipped optimizer steps that stop the run.
    """

    models: ModelChunks
    optimizer: Any
    algorithm: Any
    loss: Callable
    layout: MicroBatchLayout
    token_stats: TokenStatsOptions
    importance_sampling: ImportanceSamplingConfig
    dp_size: int
    dp_rank: int
    reports_metrics: bool
    counts_once: bool
    max_skipped_steps: int


@dataclass
class SkippedSteps:
    """Optimizer steps skipped for non-finite values: how many in a row (across rollouts) and the
    current rollout's messages, one per skipped mini-batch."""

    in_a_row: int = 0
    messages: List[str] = field(default_factory=list)


def algorithm_loss(algorithm, inputs: LossInputs):
    """``algorithm``'s loss (the registry's Algorithm) on one micro-batch's inputs; its AlgorithmLoss."""
    return algorithm.loss(
        inputs.logprob,
        inputs.old_logprob,
        inputs.mask,
        inputs.coefficients,
        normalizer=inputs.normalizer,
        ref_logprob=inputs.ref_logprob,
        current_kl=inputs.current_kl,
        token_weight=inputs.token_weight,
        group_ids=inputs.group_ids if algorithm.needs_whole_groups else None,
    )


def minibatch_normalizer(samples: Sequence[RolloutSample], indices, unit: str) -> float:
    """Global denominator of the loss aggregation over the mini-batch ``indices`` (all DP ranks).

    ``unit``: the algorithm's ``normalizer_unit``, "tokens" (trainable response tokens, the policy's own) or
    sequences (trainable responses with a token).
    """
    counted = [samples[i].policy_length for i in indices if samples[i].trainable]
    if unit == "tokens":
        return float(sum(counted))
    return float(sum(1 for c in counted if c > 0))


def _micro_batches(update: PolicyUpdate, step: RolloutStep, indices) -> List[MicroBatch]:
    """This rank's micro-batches of ``indices``: the step's own (each share collated once), or
    collated afresh for a step put together by hand (``step.micro_batches`` None)."""
    if step.micro_batches is not None:
        return step.micro_batches(indices)
    return collate_micro_batches(step.samples, indices, update.layout)


def importance_weights(old_logprob, behaviour_logprob, mask, config: ImportanceSamplingConfig, over_sequence=None):
    """Importance-sampling weights pi_old / pi_behaviour per token, [N, T] -> [N, T].

    ``behaviour_logprob``: the log-prob of each token under the policy that sampled it, as the rollout
    engine returned it (with partial rollouts a response's tokens come from several weight versions,
    each with its own); ``mask`` marks response tokens. Per token r = exp(old - behaviour);
    "truncate" clamps r into [lower, upper], "mask" weighs tokens inside it 1 and the rest 0,
    "icepop" keeps r inside it and zeroes the rest (two-sided mask). Whole responses get weight 0
    when a token ratio is below ``config.veto``, or with ``config.sequence_mask`` when their
    geometric-mean ratio exp(mean log r) leaves [sequence_lower, sequence_upper].
    ``over_sequence`` ([N, k] float -> [N, k]), when given, sums per-response partial sums over the
    ranks holding the other tokens of the same responses (context parallelism).
    """
    log_ratio = (old_logprob - behaviour_logprob).clamp(max=20.0) * mask
    ratio = torch.exp(log_ratio) * mask
    selected = mask > 0
    per_response = torch.stack(
        [((ratio < config.veto) & selected).sum(-1), log_ratio.sum(-1), selected.sum(-1)], dim=-1
    ).to(torch.float32)
    if over_sequence is not None:
        per_response = over_sequence(per_response)
    vetoed, log_sum, count = per_response.unbind(-1)
    dropped = vetoed > 0
    if config.sequence_mask:
        geometric = torch.exp(log_sum / count.clamp(min=1.0))
        dropped |= (count > 0) & ((geometric < config.sequence_lower) | (geometric > config.sequence_upper))
    inside = (ratio >= config.lower) & (ratio <= config.upper)
    if config.mode == "truncate":
        weight = ratio.clamp(config.lower, config.upper)
    elif config.mode == "mask":
        weight = inside.to(ratio.dtype)
    else:  # icepop
        weight = torch.where(inside, ratio, torch.zeros_like(ratio))
    return torch.where(dropped.unsqueeze(-1), torch.zeros_like(weight), weight) * mask


def sum_over_context_parallel(values: torch.Tensor) -> torch.Tensor:
    """[N, k] per-response partial sums summed over the context-parallel group (identity without CP).
    Collective over CP."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return values
    import torch.distributed as dist

    values = values.clone()
    dist.all_reduce(values, group=ps.get_context_parallel_group())
    return values


def _rows(flat: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Flat response-token vector [R_total] -> right-padded rows [b, max(lengths)]."""
    return torch.nn.utils.rnn.pad_sequence(list(flat.split(list(lengths))), batch_first=True)


def loss_inputs(
    update: PolicyUpdate, mb: MicroBatch, hidden_out, step: RolloutStep, normalizer: float, use_reference: bool
) -> LossInputs:
    """The loss inputs of one micro-batch from the last stage's hidden states (policy, or both side by side)."""
    models, options = update.models, update.token_stats
    hidden_size = models.hidden_size
    positions = mb.response_positions
    flat = hidden_out.reshape(-1, 2 * hidden_size if use_reference else hidden_size).index_select(0, positions)
    targets = mb.targets.reshape(-1).index_select(0, positions)
    weight = output_weight(models.policy)
    lengths = mb.response_lengths
    current_kl = None
    if use_reference:
        hidden, ref_hidden = flat.split(hidden_size, dim=-1)
        current = token_stats_on_shard(
            hidden, weight, targets, ref_hidden, output_weight(models.reference), options=options
        )
        current_kl = _rows(current.kl, lengths)
    else:
        current = token_stats_on_shard(flat, weight, targets, options=options)
    samples = step.samples
    stats = [step.experience[i] for i in mb.sample_indices]
    device = flat.device  # the experience pass's statistics are kept on the CPU between passes
    old = _rows(torch.cat([s.old_logprob for s in stats]), lengths).to(device)
    mask = _rows(
        torch.cat([torch.full((n,), float(samples[i].trainable)) for i, n in zip(mb.sample_indices, lengths)]), lengths
    ).to(device)
    token_weight = None
    is_config = update.importance_sampling
    if is_config.enabled and mb.rollout_logprobs is not None and update.algorithm.supports_token_weight:
        rollout = _rows(mb.rollout_logprobs, lengths).to(device)
        token_weight = importance_weights(old, rollout, mask, is_config, sum_over_context_parallel)
    return LossInputs(
        sample_indices=list(mb.sample_indices),
        logprob=_rows(current.logprob, lengths),
        old_logprob=old,
        ref_logprob=_rows(torch.cat([s.ref_logprob for s in stats]), lengths).to(device),
        mask=mask,
        coefficients=step.coefficients[mb.sample_indices].to(device),
        normalizer=normalizer,
        current_kl=current_kl,
        token_weight=token_weight,
        group_ids=torch.tensor([samples[i].group_id for i in mb.sample_indices], dtype=torch.long, device=device),
    )


def forward_backward(
    update: PolicyUpdate, step: RolloutStep, indices, normalizer: float, loss_fn: Callable, *, use_reference: bool
):
    """Forward-backward of ``loss_fn(LossInputs) -> (loss, report)`` over this rank's ``indices``.

    Gradients end up in the DDP grad buffers, reduced over data-parallel ranks, as for an
    update; returns the loss-func reports (last pipeline stage).
    """
    models = update.models
    model = models.with_reference() if use_reference else models.policy
    micro_batches = _micro_batches(update, step, indices)
    scale = len(micro_batches) * update.dp_size  # undo megatron's 1/num_microbatches and DDP's 1/DP

    def forward_step(mb: MicroBatch, m):
        output = models.forward(m, mb, "update")

        def loss_func(hidden_out):
            if is_padding(mb):  # expert parallelism's filler: a zero loss whose backward runs the all-to-alls
                return hidden_out.sum() * 0.0, {"loss": (0.0, 0.0, True)}
            loss, report = loss_fn(loss_inputs(update, mb, hidden_out, step, normalizer, use_reference))
            return loss * scale, report

        return output, loss_func

    models.policy.zero_grad_buffer()
    update.optimizer.zero_grad()
    return run_schedule(model, micro_batches, forward_step, forward_only=False)


def _loss_with_report(loss: Callable):
    """``loss_fn`` of the update: ``loss``'s value and its metrics as {name: (total, count, summed)}."""

    def loss_fn(inputs: LossInputs):
        result = loss(inputs)
        # Summed metrics are partial sums that add up (over micro-batches and DP ranks) to the
        # mini-batch's value; the others are per-token fractions, weighted by this batch's tokens.
        tokens = float(inputs.mask.sum())
        report = {"loss": (float(result.loss.detach()), 0.0, True)}
        for name, value in result.metrics.items():
            value = float(value)
            summed = name in result.summed_metrics
            report[name] = (value, 0.0, True) if summed else (value * tokens, tokens, False)
        if inputs.token_weight is not None and tokens:  # the off-policy correction: its mean and what it zeroed
            selected = inputs.mask > 0
            weights = inputs.token_weight[selected].float()
            report["is_weight_mean"] = (float(weights.sum()), tokens, False)
            report["is_zeroed_fraction"] = (float((weights == 0).sum()), tokens, False)
        return result.loss, report

    return loss_fn


def run_update(
    update: PolicyUpdate,
    step: RolloutStep,
    metrics: MetricAccumulator,
    skips: SkippedSteps,
    before_minibatch: Optional[Callable[[int], None]] = None,
    stop_check: Optional[StopCheck] = None,
) -> List[float]:
    """One optimizer step per mini-batch with the step's frozen coefficients; fills ``metrics``.

    ``before_minibatch(index)``, when given, runs before each mini-batch's backward (the
    diagnostics that need the ratios moved by earlier updates of this rollout). A mini-batch
    with non-finite values is skipped on every rank and recorded in ``skips`` (see
    :func:`skip_if_not_finite`). ``stop_check`` (collective) is asked before each mini-batch after
    the first; a signal's name it answers raises :class:`UpdateInterrupted` there. Returns the
    gradient norms, one per applied mini-batch.
    """
    use_reference = update.algorithm.needs_current_kl
    grad_norms = []
    if use_reference:
        update.models.place_reference(on_device=True)
    loss_fn = _loss_with_report(update.loss)
    samples, assignment = step.samples, step.assignment
    unit = update.algorithm.normalizer_unit
    started = time.perf_counter()
    for index, (minibatch, my_share) in enumerate(zip(assignment.minibatches, assignment.mine)):
        if index:  # (before the first, the trainer asked)
            try:
                stop_if_asked(
                    stop_check, UpdateProgress(index, len(assignment.minibatches), time.perf_counter() - started)
                )
            except UpdateInterrupted:
                if use_reference:
                    update.models.place_reference(on_device=False)
                raise
        if before_minibatch is not None:
            before_minibatch(index)
        reports = forward_backward(
            update, step, my_share, minibatch_normalizer(samples, minibatch, unit), loss_fn, use_reference=use_reference
        )
        if skip_if_not_finite(update, step, skips, reports, index):
            continue
        _, grad_norm, _ = update.optimizer.step()
        grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        for report in reports:
            for name, (total, count, summed) in report.items():
                metrics.add(f"update/{name}", total, count)
                if summed and update.counts_once:
                    metrics.add(f"update/{name}", 0.0, 1.0 / len(reports))  # mean over mini-batches
    if use_reference:
        update.models.place_reference(on_device=False)
    for norm in grad_norms:
        metrics.add_max("update/grad_norm_max", norm)
    metrics.add("update/grad_norm", sum(grad_norms), len(grad_norms))
    return grad_norms


class NonFiniteUpdateError(RuntimeError):
    """``train.max_skipped_steps`` consecutive optimizer steps had a non-finite loss or gradient."""


def skip_if_not_finite(update: PolicyUpdate, step: RolloutStep, skips: SkippedSteps, reports, minibatch: int) -> bool:
    """Collective: whether this mini-batch's optimizer step is skipped on every rank.

    megatron-core's optimizers check for inf/NaN only with an fp16 loss scaler; with fp32 or
    bf16 parameters a NaN gradient would reach the weights (clipping scales by NaN). So every
    rank checks its loss reports and its whole local gradient buffers (non-finite values
    survive the data-parallel reduction), and one all-reduce makes the decision common. A skip
    leaves weights and optimizer state untouched (the next backward zeroes the gradients), is
    recorded in ``skips`` naming the step, mini-batch, ranks and micro-batches, and
    ``update.max_skipped_steps`` in a row raise :class:`NonFiniteUpdateError`.
    """
    import torch.distributed as dist

    bad_micro_batch = next((i for i, report in enumerate(reports) if not math.isfinite(report["loss"][0])), -1)
    finite_grads = all(bool(torch.isfinite(buffer.grad_data).all()) for buffer in update.models.policy.buffers)
    flag = torch.tensor([float(bad_micro_batch >= 0 or not finite_grads)], device=compute_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        skips.in_a_row = 0
        return False
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (bad_micro_batch, finite_grads))
    where = "; ".join(
        f"rank {rank}: " + (f"non-finite loss in micro-batch {micro}" if micro >= 0 else "non-finite gradient")
        for rank, (micro, finite) in enumerate(seen)
        if micro >= 0 or not finite
    )
    skips.messages.append(f"step {step.index}, mini-batch {minibatch}: optimizer step skipped on every rank ({where})")
    skips.in_a_row += 1
    if skips.in_a_row >= update.max_skipped_steps:
        raise NonFiniteUpdateError(
            f"{skips.in_a_row} consecutive optimizer steps skipped for non-finite "
            f"values (train.max_skipped_steps = {update.max_skipped_steps}); "
            f"last: {skips.messages[-1]}"
        )
    return True


def gradient_vector(
    update: PolicyUpdate,
    step: RolloutStep,
    indices,
    normalizer: float,
    loss_fn: Callable,
    *,
    use_reference: bool = False,
) -> torch.Tensor:
    """This rank's share of the parameter gradient of a custom loss, as one flat fp32 vector.

    ``loss_fn(LossInputs) -> scalar`` is evaluated on every micro-batch of this rank's
    ``indices`` (normalise with ``inputs.normalizer``, the global ``normalizer``). The
    gradient is reduced over data-parallel ranks; the vector holds the trained parameters this rank
    owns in the model-parallel group (no TP duplicates, no second copy of a tied embedding),
    so :func:`gradient_dot` of two such vectors is the full-model inner product. The update's
    gradient buffers are zeroed afterwards: probes never reach an optimizer step. Collective.
    """
    from megatron.core import tensor_parallel

    from megatron_zcpo.utils.runtime import unwrap

    policy = update.models.policy
    forward_backward(
        update, step, indices, normalizer, lambda inputs: (loss_fn(inputs), {}), use_reference=use_reference
    )
    policy.finish_grad_sync()
    pieces = []
    gpt = unwrap(policy)
    tied_copy = gpt.share_embeddings_and_output_weights and not gpt.pre_process
    for name, param in gpt.named_parameters():
        if not param.requires_grad or not tensor_parallel.param_is_not_tensor_parallel_duplicate(param):
            continue  # a frozen parameter (a LoRA policy's base) has no gradient
        if tied_copy and name == "output_layer.weight":
            continue
        grad = getattr(param, "main_grad", None)
        pieces.append((grad if grad is not None else torch.zeros_like(param)).detach().float().reshape(-1).clone())
    policy.zero_grad_buffer()
    update.optimizer.zero_grad()
    return torch.cat(pieces) if pieces else torch.zeros(0)


def gradient_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """Full-model inner product of two :func:`gradient_vector` results (all-reduced over TP x PP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    value = (a.double() * b.double()).sum().reshape(1).to(compute_device())
    dist.all_reduce(value, group=ps.get_model_parallel_group())
    return float(value)
