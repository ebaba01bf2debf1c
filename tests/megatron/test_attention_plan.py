"""The packed attention's per-micro-batch plan: bit-identical to recomputing it per call, never stale."""

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_zcpo.megatron.attention import _batched, _plan_of, attention_plan, packed_attention
from megatron_zcpo.training.batch import RolloutSample, collate_packed


# ----------------------------------------------------------------------------- the reference: the old per-call path
def _reference_bucket(query, key, value, lengths, offsets, scale, cp_rank, cp_size, local_tokens):
    local = lengths // cp_size
    j = torch.arange(int(local.max()), device=query.device).unsqueeze(0)
    query_valid = j < local.unsqueeze(1)
    query_index = torch.where(query_valid, offsets.unsqueeze(1) + j, torch.zeros_like(j))
    queries = _batched(query, query_index)
    if cp_size == 1:
        out = F.scaled_dot_product_attention(
            queries, _batched(key, query_index), _batched(value, query_index), is_causal=True, scale=scale
        )
    else:
        chunk = (lengths // (2 * cp_size)).unsqueeze(1)
        mirrored = 2 * cp_size - 1 - cp_rank
        query_position = torch.where(j < chunk, cp_rank * chunk + j, mirrored * chunk + j - chunk)
        query_position = torch.where(query_valid, query_position, torch.zeros_like(j))
        p = torch.arange(int(lengths.max()), device=query.device).unsqueeze(0)
        key_valid = p < lengths.unsqueeze(1)
        which = p // chunk
        owner = torch.where(which < cp_size, which, 2 * cp_size - 1 - which)
        within = torch.where(which < cp_size, p - which * chunk, chunk + p - which * chunk)
        key_index = torch.where(key_valid, owner * local_tokens + offsets.unsqueeze(1) + within, torch.zeros_like(p))
        mask = (p.unsqueeze(1) <= query_position.unsqueeze(2)) & key_valid.unsqueeze(1)
        out = F.scaled_dot_product_attention(
            queries, _batched(key, key_index), _batched(value, key_index), attn_mask=mask.unsqueeze(1), scale=scale
        )
    return out.transpose(1, 2)[query_valid], query_index[query_valid]


def _reference(query, key, value, cu_seqlens, scale, cp_rank, cp_size):
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    local = lengths // cp_size
    offsets = torch.cumsum(local, 0) - local
    bucket = torch.floor(torch.log2(lengths.double())).long()
    outputs, indices = [], []
    for value_of_bucket in torch.unique(bucket).tolist():
        chosen = torch.nonzero(bucket == value_of_bucket).reshape(-1)
        out, index = _reference_bucket(
            query, key, value, lengths[chosen], offsets[chosen], scale, cp_rank, cp_size, query.shape[0]
        )
        outputs.append(out)
        indices.append(index)
    return torch.cat(outputs).index_select(0, torch.argsort(torch.cat(indices)))


# ----------------------------------------------------------------------------- tests
def _cu_seqlens(seed, cp_size, sequences=24):
    rng = random.Random(seed)
    multiple = 2 * cp_size if cp_size > 1 else 1
    lengths = [multiple * rng.choice([1, 2, 3, 5, 8, 13, 21, 40]) for _ in range(sequences)]
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_planned_attention_matches_the_per_call_path_with_gradients(seed, cp_size):
    cu_seqlens = _cu_seqlens(seed, cp_size)
    local_tokens, heads, dim = int(cu_seqlens[-1]) // cp_size, 3, 8
    scale = 1 / math.sqrt(dim)
    generator = torch.Generator().manual_seed(seed)
    for cp_rank in range(cp_size):
        # key/value as gathered over the CP group: [cp * t, heads, d]
        inputs = [
            torch.randn(n, heads, dim, generator=generator, dtype=torch.float64)
            for n in (local_tokens, cp_size * local_tokens, cp_size * local_tokens)
        ]
        grad_out = torch.randn(local_tokens, heads, dim, generator=generator, dtype=torch.float64)
        results = []
        for run in ("planned", "reference"):
            q, k, v = (x.clone().requires_grad_() for x in inputs)
            if run == "planned":
                out = packed_attention(q, k, v, attention_plan(cu_seqlens, cp_rank, cp_size, q.device), scale, cp_size)
            else:
                out = _reference(q, k, v, cu_seqlens, scale, cp_rank, cp_size)
            out.backward(grad_out)
            results.append((out.detach(), q.grad, k.grad, v.grad))
        for planned, reference in zip(*results):
            assert torch.equal(planned, reference)


def test_plan_is_shared_by_calls_on_one_micro_batch_and_never_by_another():
    samples = [
        RolloutSample([1, 2, 3], [4, 5], group_id=0, reward=0.0),
        RolloutSample([6], [7, 8, 9, 10], group_id=0, reward=0.0),
    ]
    params = collate_packed(samples, [0, 1]).packed_seq_params
    plan = _plan_of(params, 0, 1, "cpu")
    assert _plan_of(params, 0, 1, torch.device("cpu")) is plan  # later layers, the reference, later passes
    assert _plan_of(params, 1, 2, "cpu") is not plan  # another rank's layout is its own
    # Another micro-batch, even with equal boundaries, and the moved copy MicroBatch.to makes: planned afresh.
    assert _plan_of(collate_packed(samples, [0, 1]).packed_seq_params, 0, 1, "cpu") is not plan
    assert _plan_of(dataclasses.replace(params), 0, 1, "cpu") is not plan
    # Boundaries replaced or changed in place: planned afresh, from the new values.
    params.cu_seqlens_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    replaced = _plan_of(params, 0, 1, "cpu")
    assert replaced is not plan and replaced.local_tokens == 7
    params.cu_seqlens_q[2] = 9
    changed = _plan_of(params, 0, 1, "cpu")
    assert changed is not replaced and changed.local_tokens == 9


def test_plan_of_padded_boundaries_wins_over_the_real_ones():
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
        cu_seqlens_q_padded=torch.tensor([0, 4, 8], dtype=torch.int32),
    )
    plan = _plan_of(params, 1, 2, "cpu")
    assert plan.local_tokens == 4 and plan.source is params.cu_seqlens_q_padded
