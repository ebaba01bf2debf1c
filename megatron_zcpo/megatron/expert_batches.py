"""Equal micro-batch counts on every rank of an expert-parallel group (the MoE all-to-all needs each rank's forward).

With expert parallelism the EP group spans data-parallel ranks: every MoE layer's token
dispatch is an all-to-all in which each EP rank takes part once per micro-batch, forward and
backward. Data-parallel ranks pack their own samples into as many micro-batches as the token
budget needs, which may differ; a rank with fewer would leave the others waiting in an all-to-all.
So, under expert parallelism, every rank pads its list to the largest count in the data-parallel
(x context-parallel) group with *padding micro-batches*: one padding token, no sample, no response
position. They run through the model (and its all-to-alls) and contribute nothing to any loss or
statistic: the passes skip their loss (:func:`is_padding`), the update backpropagates a zero.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from megatron_zcpo.megatron.batch import MicroBatch, RolloutSample, collate, collate_packed
from megatron_zcpo.utils.devices import compute_device


def is_padding(micro_batch: MicroBatch) -> bool:
    """Whether ``micro_batch`` is a padding micro-batch (it holds no sample)."""
    return not micro_batch.sample_indices


def padding_micro_batch(packing: str, cp_rank: int = 0, cp_size: int = 1, sp_size: int = 1) -> MicroBatch:
    """A micro-batch of one padding token (id 0; padded for CP/SP like any sequence) with no
    sample and no response position, in the trainer's packing ("thd" or "padded")."""
    filler = [RolloutSample([0], [0], group_id=-1, reward=0.0)]
    if packing == "padded":
        micro_batch = collate(filler, [0], sp_size=sp_size)
    else:
        micro_batch = collate_packed(filler, [0], cp_rank, cp_size, sp_size=sp_size)
    empty = torch.zeros(0, dtype=torch.long)
    return dataclasses.replace(micro_batch, response_positions=empty, response_token_index=empty,
                               response_lengths=[], sample_indices=[], rollout_logprobs=None)


def pad_to_expert_parallel_count(micro_batches: List[MicroBatch], packing: str, cp_rank: int = 0, cp_size: int = 1,
                                 sp_size: int = 1) -> List[MicroBatch]:
    """``micro_batches`` followed by padding micro-batches up to the largest count of the
    data-parallel x context-parallel group, when expert parallelism is on (unchanged otherwise).

    Collective over that group when EP > 1: every rank must call it for the same pass.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1:
        return micro_batches
    count = torch.tensor([len(micro_batches)], dtype=torch.long, device=compute_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
    missing = int(count) - len(micro_batches)
    if missing == 0:
        return micro_batches
    filler = padding_micro_batch(packing, cp_rank, cp_size, sp_size).to(compute_device())
    return micro_batches + [filler] * missing
