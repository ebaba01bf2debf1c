"""Gradient passes of restricted losses over a rollout, and the seeded token / group samples they measure."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import active_groups
from megatron_zcpo.diagnostics.branches import restrict
from megatron_zcpo.training.rollout_step import RolloutStep
from megatron_zcpo.training.update import PolicyUpdate, gradient_dot, gradient_vector, minibatch_normalizer

Selector = Callable[[object], Tensor]  # LossInputs -> [b, T] bool


class GradientProbe:
    """Parameter gradients of custom losses over chosen samples and tokens of one rollout (collective).

    Wraps :func:`megatron_zcpo.training.update.gradient_vector`: every call is a forward-backward on
    every rank (gradients DP-reduced, never applied). A data-parallel rank that holds none of the chosen samples still
    runs one of its own samples of the same mini-batch with a zero loss, so the collectives match.
    """

    def __init__(self, update: PolicyUpdate, step: RolloutStep):
        """update: what the passes run with (models, optimizer, algorithm); step: the RolloutStep
        whose samples the passes run over."""
        self.update = update
        self.step = step
        self.samples = step.samples
        assignment = step.assignment
        self.minibatches = assignment.minibatches
        self.minibatch_of = {index: k for k, minibatch in enumerate(assignment.minibatches) for index in minibatch}
        self.mine = [set(share) for share in assignment.mine]

    def gradient(
        self, indices: Sequence[int], loss: Callable, select: Optional[Selector] = None, use_reference: bool = False
    ) -> Tensor:
        """This rank's flat gradient share of ``loss(restrict(inputs, select(inputs)))`` over samples ``indices``.

        indices: global sample indices, all in one mini-batch (its normaliser is used, so the
        gradient is those samples' share of that mini-batch's update). select: the tokens whose
        gradient counts (default: every trainable token). loss: LossInputs -> scalar (called on the
        last pipeline stage only). use_reference: the loss needs ``current_kl``.
        """
        minibatch = self.minibatch_of[indices[0]]
        if any(self.minibatch_of[i] != minibatch for i in indices):
            raise ValueError(f"samples {list(indices)} span several mini-batches")
        mine = sorted(set(indices) & self.mine[minibatch])
        idle = not mine
        if idle:
            mine = [min(self.mine[minibatch])]

        def loss_fn(inputs):
            # keeps the loss attached to the graph when no selected token is in this micro-batch
            anchor = torch.where(inputs.mask != 0, inputs.logprob, torch.zeros_like(inputs.logprob)).sum() * 0.0
            if idle:
                return anchor
            selection = (inputs.mask != 0) if select is None else select(inputs)
            return loss(restrict(inputs, selection)) + anchor

        unit = self.update.algorithm.normalizer_unit
        normalizer = minibatch_normalizer(self.samples, self.minibatches[minibatch], unit)
        return gradient_vector(self.update, self.step, mine, normalizer, loss_fn, use_reference=use_reference)

    def norm(self, vector: Tensor) -> float:
        """Full-model norm of a gradient vector (collective)."""
        return max(gradient_dot(vector, vector), 0.0) ** 0.5

    def token_norm(self, sample_index: int, position: int, loss: Callable) -> float:
        """||u_t||: the norm of one token's share of ``loss``'s gradient (a single-token pass; collective)."""
        return self.norm(self.gradient([sample_index], loss, select=single_token(sample_index, position)))


def single_token(sample_index: int, position: int) -> Selector:
    """Selector of the response token at ``position`` of sample ``sample_index``."""

    def select(inputs) -> Tensor:
        selection = torch.zeros_like(inputs.mask, dtype=torch.bool)
        if sample_index in inputs.sample_indices:
            selection[inputs.sample_indices.index(sample_index), position] = True
        return selection & (inputs.mask != 0)

    return select


def trainable_tokens(samples, indices: Sequence[int]) -> Tensor:
    """[M, 2] int64 (sample index, position) of every trainable response token of ``samples[indices]``
    (the policy's own: a position counts the policy's tokens, tool turns hold none)."""
    rows = [(i, t) for i in indices if samples[i].trainable for t in range(samples[i].policy_length)]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 2)


def uniform_tokens(samples, indices: Sequence[int], count: int, generator: torch.Generator) -> Tensor:
    """[min(count, M), 2] trainable tokens of ``samples[indices]`` drawn uniformly without replacement
    (all M of them, in order, when count >= M: the estimates built on them are then exact)."""
    tokens = trainable_tokens(samples, indices)
    if count >= tokens.shape[0]:
        return tokens
    return tokens[torch.randperm(tokens.shape[0], generator=generator)[:count]]


def sample_groups(samples, count: int, generator: torch.Generator) -> List[List[int]]:
    """Up to ``count`` reward-active groups (untied rewards, >= 1 trainable token), uniformly without
    replacement; each as its sample indices. All of them, in order of appearance, when fewer exist."""
    group_ids = torch.tensor([s.group_id for s in samples], dtype=torch.long)
    active = active_groups(torch.tensor([float(s.reward) for s in samples], dtype=torch.float64), group_ids)
    members = {}
    for index, sample in enumerate(samples):
        members.setdefault(sample.group_id, []).append(index)
    candidates = [
        indices
        for indices in members.values()
        if bool(active[indices[0]]) and trainable_tokens(samples, indices).shape[0] > 0
    ]
    if count >= len(candidates):
        return candidates
    return [candidates[k] for k in sorted(torch.randperm(len(candidates), generator=generator)[:count].tolist())]
