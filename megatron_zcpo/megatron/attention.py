"""Core attention for megatron-core's local layer spec: padding-free (THD) packing and context parallelism.

megatron-core's ``DotProductAttention`` (the local spec) refuses packed sequences and context
parallelism; both live in Transformer Engine's attention, which needs a GPU. This module is the
local spec's core attention so that the trainer's padding-free micro-batches and its
context-parallel layout run (and are tested) on CPUs too, with the same data layout TE uses:

- THD: the micro-batch is one row of concatenated sequences; ``packed_seq_params.cu_seqlens_q``
  (or ``cu_seqlens_q_padded``) gives the global sequence boundaries; each sequence attends
  causally to itself only (RoPE positions restart per sequence in megatron's rope_utils).
- Context parallelism (THD only): every sequence, padded to a multiple of 2*CP, is cut into 2*CP
  chunks and rank r holds chunks r and 2*CP-1-r (TE's load-balanced layout). Keys and values are
  all-gathered over the context-parallel group (megatron's sequence-parallel gather: its backward
  reduce-scatters the key/value gradients), and each local query attends to the keys at global
  positions <= its own. This is O(sequence) memory per rank for keys and values, which is what a
  CPU test needs; TE's ring attention is what runs at scale.

The layout of a packed micro-batch's attention (length buckets, index tensors) is planned by
its first attention call and kept on its ``PackedSeqParams``: every layer, the reference's
forward and later passes over the same micro-batch reuse it.

Without packing and context parallelism the computation is megatron's own ``DotProductAttention``,
except under multi-latent attention (queries and keys wider than values: megatron-core 0.16.1's
``DotProductAttention`` takes neither ``k_channels`` nor ``v_channels``), where it is one causal SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F


def context_parallel_positions(length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions [length / cp_size] that context-parallel rank ``cp_rank`` holds, in local order.

    ``length`` must be a multiple of 2 * ``cp_size`` when ``cp_size > 1``: the sequence is cut
    into 2*CP equal chunks and the rank holds chunks ``cp_rank`` and ``2*CP-1-cp_rank`` (the
    causal-attention load balance of megatron/TE). With ``cp_size == 1`` it is ``arange(length)``.
    """
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        raise ValueError(f"a context-parallel sequence length must be a multiple of 2*CP={2 * cp_size}, got {length}")
    return context_parallel_position_of(torch.arange(length // cp_size), length // (2 * cp_size), cp_rank, cp_size)


def context_parallel_position_of(local_index: torch.Tensor, chunk, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions of the local tokens ``local_index`` (int64, any shape) of sequences cut into
    chunks of ``chunk`` tokens (an int or a tensor broadcasting with it) on rank ``cp_rank``: the
    first ``chunk`` local tokens are chunk ``cp_rank``, the rest chunk ``2*CP-1-cp_rank``
    (:func:`context_parallel_positions` for many sequences at once). Same shape as the broadcast."""
    mirrored = 2 * cp_size - 1 - cp_rank
    return torch.where(local_index < chunk, cp_rank * chunk + local_index, mirrored * chunk + local_index - chunk)


def _batched(tokens, index):
    """tokens [t, heads, d] gathered at index [n, L] -> [n, heads, L, d]."""
    return tokens.index_select(0, index.reshape(-1)).reshape(*index.shape, *tokens.shape[1:]).transpose(1, 2)


@dataclass
class _Bucket:
    """The index tensors of one batched SDPA call: the sequences of one length bucket as padded rows.

    query_valid/query_index [n, L]: which row slots hold a local token and its index among this
    rank's t tokens. With context parallelism also key_index [n, P] into the gathered [cp * t]
    keys, key_position [1, P], key_valid [n, P] and query_position [n, L] (global positions) for
    the causal mask; None without.
    """

    query_valid: torch.Tensor
    query_index: torch.Tensor
    key_index: Optional[torch.Tensor] = None
    key_position: Optional[torch.Tensor] = None
    key_valid: Optional[torch.Tensor] = None
    query_position: Optional[torch.Tensor] = None


@dataclass
class _AttentionPlan:
    """The layout of one packed micro-batch's attention on one CP rank: its buckets, where each local
    token's output lies among theirs and the tokens per rank, with the boundaries tensor it was
    computed from."""

    source: torch.Tensor  # the cu_seqlens tensor (held, so its identity cannot pass to another tensor)
    version: int  # source._version when planned: an in-place change makes the plan stale
    local_tokens: int
    buckets: List[_Bucket]
    gather: torch.Tensor  # [t]: each local token's row in the buckets' [n, L] output slots laid end to end


def _bucket(lengths, offsets, cp_rank, cp_size, local_tokens, device) -> _Bucket:
    """The :class:`_Bucket` of sequences with global (padded) lengths [n] whose local tokens start at offsets [n]."""
    local = lengths // cp_size
    j = torch.arange(int(local.max()), device=device).unsqueeze(0)
    query_valid = j < local.unsqueeze(1)
    query_index = torch.where(query_valid, offsets.unsqueeze(1) + j, torch.zeros_like(j))
    if cp_size == 1:
        return _Bucket(query_valid, query_index)
    chunk = (lengths // (2 * cp_size)).unsqueeze(1)
    query_position = context_parallel_position_of(j, chunk, cp_rank, cp_size)
    query_position = torch.where(query_valid, query_position, torch.zeros_like(j))
    p = torch.arange(int(lengths.max()), device=device).unsqueeze(0)
    key_valid = p < lengths.unsqueeze(1)
    which = p // chunk  # the chunk holding global position p; its owner and offset there:
    owner = torch.where(which < cp_size, which, 2 * cp_size - 1 - which)
    within = torch.where(which < cp_size, p - which * chunk, chunk + p - which * chunk)
    key_index = torch.where(key_valid, owner * local_tokens + offsets.unsqueeze(1) + within, torch.zeros_like(p))
    return _Bucket(query_valid, query_index, key_index, p, key_valid, query_position)


def attention_plan(cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int, device) -> _AttentionPlan:
    """The :class:`_AttentionPlan` of the packed sequences with boundaries ``cu_seqlens`` [n + 1]
    (global, padded) on context-parallel rank ``cp_rank``; index tensors on ``device``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    local = lengths // cp_size
    offsets = torch.cumsum(local, 0) - local
    local_tokens = int(local.sum())
    # Sequences of similar length (same power of two) share one batched call: padding within a
    # bucket stays under 4x the causal work, and a few calls replace a loop over sequences.
    bucket = torch.floor(torch.log2(lengths.double())).long()
    buckets = []
    for value_of_bucket in torch.unique(bucket).tolist():
        chosen = torch.nonzero(bucket == value_of_bucket).reshape(-1)
        buckets.append(_bucket(lengths[chosen], offsets[chosen], cp_rank, cp_size, local_tokens, device))
    slots, tokens, base = [], [], 0
    for b in buckets:
        slots.append(base + torch.nonzero(b.query_valid.reshape(-1)).reshape(-1))
        tokens.append(b.query_index[b.query_valid])
        base += b.query_valid.numel()
    gather = torch.cat(slots).index_select(0, torch.argsort(torch.cat(tokens)))
    version = -1 if cu_seqlens.is_inference() else cu_seqlens._version
    return _AttentionPlan(cu_seqlens, version, local_tokens, buckets, gather)


def _plan_of(packed_seq_params, cp_rank: int, cp_size: int, device) -> _AttentionPlan:
    """The micro-batch's plan, computed by its first attention call and reused by every later one.

    Kept on the micro-batch's own ``PackedSeqParams`` object: all layers, the reference's forward
    and later passes over the same micro-batch share it; another micro-batch (a new object, also
    after ``MicroBatch.to``, which replaces it) starts without one. Reused only while the
    boundaries are the same tensor, unmodified (inference tensors have no version: never reused).
    """
    cu_seqlens = packed_seq_params.cu_seqlens_q_padded
    if cu_seqlens is None:
        cu_seqlens = packed_seq_params.cu_seqlens_q
    plans = vars(packed_seq_params).setdefault("_packed_attention_plans", {})
    key = (cp_rank, cp_size, torch.device(device))
    plan = plans.get(key)
    if (
        plan is None
        or plan.source is not cu_seqlens
        or cu_seqlens.is_inference()
        or plan.version != cu_seqlens._version
    ):
        plan = plans[key] = attention_plan(cu_seqlens, cp_rank, cp_size, device)
    return plan


def packed_attention(query, key, value, plan: _AttentionPlan, scale: float, cp_size: int) -> torch.Tensor:
    """Causal attention of a packed micro-batch laid out by ``plan``.

    query [t, heads, d] (this rank's tokens); key/value [t, heads, d], or [cp * t, heads, d]
    gathered over the CP group. Each bucket's sequences are one padded batch
    [n, heads, longest, d] for one SDPA call; returns [t, heads, d] in token order.
    """
    outputs = []
    for bucket in plan.buckets:
        queries = _batched(query, bucket.query_index)
        if cp_size == 1:
            # Padding rows sit after each sequence's tokens: causal masking keeps real queries off them.
            out = F.scaled_dot_product_attention(
                queries,
                _batched(key, bucket.query_index),
                _batched(value, bucket.query_index),
                is_causal=True,
                scale=scale,
            )
        else:
            mask = (
                bucket.key_position.unsqueeze(1) <= bucket.query_position.unsqueeze(2)
            ) & bucket.key_valid.unsqueeze(1)
            out = F.scaled_dot_product_attention(
                queries,
                _batched(key, bucket.key_index),
                _batched(value, bucket.key_index),
                attn_mask=mask.unsqueeze(1),
                scale=scale,
            )
        outputs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))  # [n * L, heads, d]
    return torch.cat(outputs).index_select(0, plan.gather)


def causal_attention_sbhd(query, key, value, attention_mask, scale: float) -> torch.Tensor:
    """Causal attention of padded rows: query/key ``[s, b, heads, d_k]``, value ``[s, b, heads, d_v]``;
    ``attention_mask`` None or megatron's boolean mask (True: masked out) ``[b, 1, s, s]``.
    Returns ``[s, b, heads * d_v]``."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~attention_mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


class PackedCausalAttention(torch.nn.Module):
    """Causal core attention accepting megatron's THD ``packed_seq_params`` and context parallelism.

    Built by megatron's ``SelfAttention`` (or ``MLASelfAttention``, which adds ``k_channels`` /
    ``v_channels``: query/key and value widths) from the layer spec (see
    :func:`megatron_zcpo.megatron.local_spec.local_layer_spec`), with the ``CoreAttentionBuilder``
    keywords. Forward: sbhd ``[s, b, heads, d]`` tensors without packing (delegated to megatron's
    DotProductAttention, or one causal SDPA for multi-latent attention; context parallelism
    refused), THD ``[t, heads, d]`` with packing. Returns ``[s, b, heads*d_v]`` or ``[t, heads*d_v]``.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        k_channels=None,
        v_channels=None,
    ):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"PackedCausalAttention has no attention dropout (got {dropout}); RL training uses 0")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCausalAttention is causal only, got {attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels or config.kv_channels)
        # The unpacked path is megatron's own module (it asserts context_parallel_size == 1), but
        # for multi-latent attention's wider queries and keys (self.latent: an SDPA of our own).
        self.latent = k_channels is not None or v_channels is not None
        self.unpacked = None
        if config.context_parallel_size == 1 and not self.latent:
            self.unpacked = DotProductAttention(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout,
                softmax_scale,
                cp_comm_type,
                pg_collection,
            )

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if (packed_seq_params is None or packed_seq_params.qkv_format != "thd") and self.latent:
            if self.cp_group.size() > 1:
                raise ValueError("context parallelism needs packed (THD) micro-batches on the local layer spec")
            return causal_attention_sbhd(query, key, value, attention_mask, self.scale)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            if self.unpacked is None:
                raise ValueError("context parallelism needs packed (THD) micro-batches on the local layer spec")
            return self.unpacked(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        if attention_bias is not None:
            raise ValueError("PackedCausalAttention takes no attention_bias")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        plan = _plan_of(packed_seq_params, cp_rank, cp_size, query.device)
        if plan.local_tokens != query.shape[0]:
            raise ValueError(
                f"packed_seq_params cover {plan.local_tokens} tokens per rank, the micro-batch has {query.shape[0]}"
            )
        if self.heads != self.groups:  # grouped-query attention: share each key/value head
            key = key.repeat_interleave(self.heads // self.groups, dim=1)
            value = value.repeat_interleave(self.heads // self.groups, dim=1)
        if cp_size > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # [cp * t, heads, d]; the backward reduce-scatters: each rank's keys serve every rank's queries.
            key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
        return packed_attention(query, key, value, plan, self.scale, cp_size).reshape(query.shape[0], -1)
