"""Rollout batches: mini-batches that keep groups whole, data-parallel shares, packed micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch


@dataclass
class RolloutSample:
    """One sampled response and what the rollout and the reward said about it.

    ``group_id`` identifies the prompt's group (responses to the same prompt share it; unique
    over the whole rollout). ``trainable`` is False for responses masked out of the loss
    (overlong filtering); they still count in their group's statistics. ``rollout_logprobs``
    are the engine's per-token log-probs of ``response_ids`` (for the mismatch correction).
    """

    prompt_ids: List[int]
    response_ids: List[int]
    group_id: int
    reward: float
    trainable: bool = True
    rollout_logprobs: Optional[List[float]] = None
    info: Dict = field(default_factory=dict)

    @property
    def sequence_length(self) -> int:
        """Tokens the model sees: prompt and response, minus the last (it predicts nothing)."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


@dataclass
class MicroBatch:
    """A padded micro-batch of whole sequences, right-padded to its longest member.

    ``tokens``/``position_ids``/``targets``: [b, S] int64 (targets[t] = token at t+1).
    ``response_mask``: [b, S] float, 1 where ``targets`` is a response token.
    ``loss_mask``: [b, S] float, ``response_mask`` of trainable samples only.
    ``rollout_logprobs``: [b, S] float aligned with ``targets`` (0 elsewhere), or None.
    ``sample_indices``: which rollout samples the rows are (positions in the global batch).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    response_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor]
    sample_indices: List[int]
    response_starts: List[int]  # index in the row where the first response target sits
    response_lengths: List[int]


def split_minibatches(group_ids: Sequence[int], num_minibatches: int) -> List[List[int]]:
    """Split sample indices into ``num_minibatches`` lists that keep every group whole.

    Groups are taken in order of first appearance and dealt into consecutive mini-batches so
    that response counts are as even as possible. Raises ``ValueError`` when there are fewer
    groups than mini-batches.
    """
    order: Dict[int, List[int]] = {}
    for index, group in enumerate(group_ids):
        order.setdefault(int(group), []).append(index)
    groups = list(order.values())
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    if len(groups) < num_minibatches:
        raise ValueError(
            f"{len(groups)} groups cannot fill {num_minibatches} mini-batches that keep groups whole"
        )
    total = sum(len(g) for g in groups)
    minibatches: List[List[int]] = [[] for _ in range(num_minibatches)]
    taken, current = 0, 0
    for position, group in enumerate(groups):
        remaining_groups = len(groups) - position
        remaining_batches = num_minibatches - current
        # Move on when this mini-batch has its share, but never leave a later one without a group.
        if minibatches[current] and current < num_minibatches - 1 and (
            taken >= total * (current + 1) / num_minibatches or remaining_groups <= remaining_batches - 1
        ):
            current += 1
        minibatches[current].extend(group)
        taken += len(group)
    return minibatches


def units_of(indices: Sequence[int], group_ids: Sequence[int], whole_groups: bool) -> List[List[int]]:
    """The indivisible units for dealing and packing: single samples, or whole groups when an
    algorithm needs every group inside one micro-batch (GVPO). Order of first appearance."""
    if not whole_groups:
        return [[i] for i in indices]
    units: Dict[int, List[int]] = {}
    for i in indices:
        units.setdefault(int(group_ids[i]), []).append(i)
    return list(units.values())


def assign_data_parallel(units: Sequence[Sequence[int]], lengths: Sequence[int], dp_size: int) -> List[List[int]]:
    """Deal units (lists of sample indices) to data-parallel ranks, balancing tokens.

    Longest unit first onto the lightest rank. Groups may be split across ranks when units are
    single samples: coefficients are calibrated on gathered per-response scalars, so a rank
    needs none of its samples' group mates. Each rank's indices come back sorted. Raises
    ``ValueError`` when there are fewer units than ranks.
    """
    if len(units) < dp_size:
        raise ValueError(f"{len(units)} units cannot give each of {dp_size} data-parallel ranks one")
    load = [0] * dp_size
    shares: List[List[int]] = [[] for _ in range(dp_size)]
    for unit in sorted(units, key=lambda u: (-sum(lengths[i] for i in u), u[0])):
        rank = min(range(dp_size), key=lambda r: (load[r], len(shares[r]), r))
        shares[rank].extend(unit)
        load[rank] += sum(lengths[i] for i in unit)
    return [sorted(share) for share in shares]


def pack_micro_batches(units: Sequence[Sequence[int]], lengths: Sequence[int], token_budget: int) -> List[List[int]]:
    """Group units into micro-batches of at most ``token_budget`` padded tokens.

    Units are sorted by their longest sample (longest first) so rows of similar length share a
    micro-batch and padding stays small; a unit over the budget gets a micro-batch of its own.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    batches: List[List[int]] = []
    for unit in sorted(units, key=lambda u: (-max(lengths[i] for i in u), u[0])):
        if batches:
            current = batches[-1]
            longest = max(lengths[i] for i in current)
            if longest * (len(current) + len(unit)) <= token_budget:
                current.extend(unit)
                continue
        batches.append(list(unit))
    return batches


def collate(samples: Sequence[RolloutSample], indices: Sequence[int], pad_id: int = 0) -> MicroBatch:
    """Build the padded :class:`MicroBatch` of ``samples[i] for i in indices``."""
    rows = [samples[i] for i in indices]
    width = max(s.sequence_length for s in rows)
    b = len(rows)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    targets = torch.full((b, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros(b, width)
    loss_mask = torch.zeros(b, width)
    with_rollout = all(s.rollout_logprobs is not None for s in rows)
    rollout = torch.zeros(b, width) if with_rollout else None
    starts, lengths = [], []
    for row, sample in enumerate(rows):
        sequence = torch.tensor(list(sample.prompt_ids) + list(sample.response_ids), dtype=torch.long)
        n = sequence.numel() - 1
        tokens[row, :n] = sequence[:-1]
        targets[row, :n] = sequence[1:]
        start, length = len(sample.prompt_ids) - 1, len(sample.response_ids)
        response_mask[row, start:start + length] = 1.0
        if sample.trainable:
            loss_mask[row, start:start + length] = 1.0
        if rollout is not None:
            if len(sample.rollout_logprobs) != length:
                raise ValueError(
                    f"sample {indices[row]}: {len(sample.rollout_logprobs)} rollout log-probs for "
                    f"{length} response tokens"
                )
            rollout[row, start:start + length] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        starts.append(start)
        lengths.append(length)
    position_ids = torch.arange(width).unsqueeze(0).expand(b, width).contiguous()
    return MicroBatch(tokens, position_ids, targets, response_mask, loss_mask, rollout, list(indices), starts, lengths)
