"""Rollout batches: mini-batches that keep groups whole, data-parallel shares, padded or packed (THD) micro-batches.

A rollout step collates each share of its samples once (:class:`StepMicroBatches`), under this
rank's :class:`MicroBatchLayout`; the experience pass, the update and the gradient probes all
take their micro-batches from there.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron_zcpo.utils.devices import compute_device


@dataclass
class RolloutSample:
    """One sampled response and what the rollout and the reward said about it.

    ``group_id`` identifies the prompt's group (responses to the same prompt share it; unique
    over the whole rollout). ``trainable`` is False for responses masked out of the loss
    (overlong filtering); they still count in their group's statistics. ``rollout_logprobs``
    are the engine's per-token log-probs of ``response_ids`` (for the mismatch correction).
    Token ids and log-probs are lists (from an engine) or 1-D tensors (views of the flat tensors
    a rollout is broadcast in, so no rank holds a Python int per token).
    ``response_mask`` (multi-turn rollouts): per response token 1 where the policy produced it and 0
    where a tool's turn was appended; masked-out tokens stay in the sequence (the model reads them)
    but hold no response position, so no loss, statistic or length counts them. None: all are the policy's.
    """

    prompt_ids: Union[List[int], torch.Tensor]
    response_ids: Union[List[int], torch.Tensor]
    group_id: int
    reward: float
    trainable: bool = True
    rollout_logprobs: Union[List[float], torch.Tensor, None] = None
    info: Dict = field(default_factory=dict)
    # Mixture-of-experts models: the engine's experts of every input token (prompt and response but
    # the last), int [sequence_length, layers * top-k] as SGLang returns them (routing replay R3).
    routed_experts: Optional[torch.Tensor] = None
    response_mask: Union[List[int], torch.Tensor, None] = None

    @property
    def policy_length(self) -> int:
        """Response tokens the policy produced (the trained ones; T_i of the length normalisation)."""
        if self.response_mask is None:
            return len(self.response_ids)
        return int(sum(int(m) for m in self.response_mask))

    @property
    def sequence_length(self) -> int:
        """Tokens the model sees: prompt and response, minus the last (it predicts nothing)."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


@dataclass
class MicroBatch:
    """One micro-batch as this rank's model sees it.

    Padded: ``tokens``/``position_ids``/``targets`` are [b, S], whole sequences right-padded to the
    longest (targets[t] = token at t+1). Packed (THD, padding-free): [1, T], the sequences
    concatenated (on a context-parallel rank: its two chunks of each), with ``packed_seq_params``.
    ``response_positions`` [R]: flat indices into [b*S] of this rank's response targets, sample by
    sample; ``response_token_index`` [R]: each one's index within its sample's response;
    ``response_lengths``: per sample, how many of its response tokens are here (all of them
    without context parallelism); ``rollout_logprobs`` [R] aligned with ``response_positions``, or
    None; ``sample_indices``: which rollout samples (positions in the global batch).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    response_positions: torch.Tensor
    response_token_index: torch.Tensor
    response_lengths: List[int]
    sample_indices: List[int]
    rollout_logprobs: Optional[torch.Tensor] = None
    packed_seq_params: Any = None

    def to(self, device) -> MicroBatch:
        """The model inputs (tokens, positions, packed-sequence boundaries) and what the loss indexes
        on the device (targets, response positions); CPU-side bookkeeping stays."""
        packed = self.packed_seq_params
        if packed is not None:
            packed = dataclasses.replace(
                packed,
                **{
                    name: getattr(packed, name).to(device)
                    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
                    if getattr(packed, name) is not None
                },
            )
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device),
            position_ids=self.position_ids.to(device),
            targets=self.targets.to(device),
            response_positions=self.response_positions.to(device),
            packed_seq_params=packed,
        )


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
        raise ValueError(f"{len(groups)} groups cannot fill {num_minibatches} mini-batches that keep groups whole")
    total = sum(len(g) for g in groups)
    minibatches: List[List[int]] = [[] for _ in range(num_minibatches)]
    taken, current = 0, 0
    for position, group in enumerate(groups):
        remaining_groups = len(groups) - position
        remaining_batches = num_minibatches - current
        # Move on when this mini-batch has its share, but never leave a later one without a group.
        if (
            minibatches[current]
            and current < num_minibatches - 1
            and (taken >= total * (current + 1) / num_minibatches or remaining_groups <= remaining_batches - 1)
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


def pack_micro_batches(
    units: Sequence[Sequence[int]], lengths: Sequence[int], token_budget: int, padded: bool = True
) -> List[List[int]]:
    """Group units into micro-batches of at most ``token_budget`` tokens.

    ``padded``: a micro-batch costs its longest length times its rows (right-padded rows);
    otherwise the sum of its lengths (padding-free THD packing). Units are sorted by their
    longest sample (longest first) so padded rows of similar length share a micro-batch; a unit
    over the budget gets a micro-batch of its own.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")

    batches: List[List[int]] = []
    longest = total = 0  # of the open (last) micro-batch
    for unit in sorted(units, key=lambda u: (-max(lengths[i] for i in u), u[0])):
        unit_longest, unit_total = max(lengths[i] for i in unit), sum(lengths[i] for i in unit)
        rows = len(batches[-1]) + len(unit) if batches else 0
        cost = max(longest, unit_longest) * rows if padded else total + unit_total
        if batches and cost <= token_budget:
            batches[-1].extend(unit)
            longest, total = max(longest, unit_longest), total + unit_total
        else:
            batches.append(list(unit))
            longest, total = unit_longest, unit_total
    return batches


@dataclass
class _FlatSamples:
    """The token ids, lengths and rollout log-probs of some samples, concatenated (one tensor each)."""

    ids: torch.Tensor  # [sum of prompt + response lengths] int64: each sample's prompt, then its response
    starts: torch.Tensor  # [n] int64: where each sample's ids start in ``ids``
    inputs: List[int]  # per sample, the tokens the model sees (prompt + response - 1)
    prompt: torch.Tensor  # [n] int64 prompt lengths
    response: torch.Tensor  # [n] int64 response lengths
    rollout: Optional[torch.Tensor]  # [sum of response lengths] float32, or None when a sample has none
    policy: torch.Tensor  # [sum of response lengths] bool: the policy's tokens (False: a tool's turn)


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """Where each of consecutive pieces of ``lengths`` [n] starts: [n] exclusive prefix sums."""
    return torch.cumsum(lengths, 0) - lengths


def _concatenated(pieces: List, dtype: torch.dtype) -> torch.Tensor:
    """One 1-D ``dtype`` tensor of lists or tensors laid end to end: one conversion, not one per piece."""
    if all(isinstance(piece, list) for piece in pieces):
        return torch.tensor(list(itertools.chain.from_iterable(pieces)), dtype=dtype)
    if all(isinstance(piece, torch.Tensor) for piece in pieces):
        return torch.cat(pieces).to(dtype)
    return torch.cat([torch.as_tensor(piece, dtype=dtype) for piece in pieces])


def _flatten(samples: Sequence[RolloutSample], indices: Sequence[int]) -> _FlatSamples:
    """``samples[i] for i in indices`` as :class:`_FlatSamples`; raises ``ValueError`` naming the first
    sample whose rollout log-probs do not match its response length, or when ``indices`` is empty."""
    if not indices:
        raise ValueError("a micro-batch needs at least one sample")
    chosen = [samples[i] for i in indices]
    prompt = [len(s.prompt_ids) for s in chosen]
    response = [len(s.response_ids) for s in chosen]
    for index, sample, length in zip(indices, chosen, response):
        if sample.rollout_logprobs is not None and len(sample.rollout_logprobs) != length:
            raise ValueError(
                f"sample {index}: {len(sample.rollout_logprobs)} rollout log-probs for {length} response tokens"
            )
        if sample.response_mask is not None and len(sample.response_mask) != length:
            raise ValueError(f"sample {index}: response_mask of {len(sample.response_mask)} for {length} tokens")
    total = torch.tensor([p + r for p, r in zip(prompt, response)], dtype=torch.long)
    has_rollout = all(s.rollout_logprobs is not None for s in chosen)
    return _FlatSamples(
        ids=_concatenated([ids for s in chosen for ids in (s.prompt_ids, s.response_ids)], torch.long),
        starts=_starts(total),
        inputs=[max(p + r - 1, 0) for p, r in zip(prompt, response)],
        prompt=torch.tensor(prompt, dtype=torch.long),
        response=torch.tensor(response, dtype=torch.long),
        rollout=_concatenated([s.rollout_logprobs for s in chosen], torch.float32) if has_rollout else None,
        policy=_concatenated(
            [s.response_mask if s.response_mask is not None else [1] * n for s, n in zip(chosen, response)],
            torch.long,
        ).bool(),
    )


def _shifted_pair(flat: _FlatSamples, sample: torch.Tensor, position: torch.Tensor, pad_id: int):
    """(inputs, targets) at ``position`` of each token's ``sample`` (same shapes): the sequence's token
    at that position and the next one, or ``pad_id`` past its inputs."""
    real = position < torch.tensor(flat.inputs, dtype=torch.long)[sample]
    # Padding reads ids[0] (discarded): any index it reads must exist.
    source = torch.where(real, flat.starts[sample] + position, torch.zeros_like(position))
    pad = torch.full_like(position, pad_id)
    return torch.where(real, flat.ids[source], pad), torch.where(real, flat.ids[source + real.long()], pad)


def collate(samples: Sequence[RolloutSample], indices: Sequence[int], pad_id: int = 0, sp_size: int = 1) -> MicroBatch:
    """The padded :class:`MicroBatch` of ``samples[i] for i in indices``: rows [b, S].

    S is the longest row rounded up to a multiple of ``sp_size`` (the tensor-parallel size when
    sequence parallelism scatters the sequence dimension over TP ranks, else 1). Padding sits
    after each row's tokens: causal attention keeps real tokens off it and no response position
    points into it, so it never reaches a loss.
    """
    flat = _flatten(samples, indices)
    rows = len(flat.inputs)
    width = -(-max(flat.inputs) // sp_size) * sp_size
    row = torch.arange(rows).unsqueeze(1).expand(rows, width)
    tokens, targets = _shifted_pair(flat, row, torch.arange(width).unsqueeze(0).expand(rows, width), pad_id)
    # Response token k of row r is target position (prompt - 1 + k), flat index r * S + that; tool
    # tokens (multi-turn) hold no response position.
    owner = torch.repeat_interleave(torch.arange(rows), flat.response)
    token_index = torch.arange(owner.numel()) - _starts(flat.response)[owner]
    owner, token_index = owner[flat.policy], token_index[flat.policy]
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(width).unsqueeze(0).expand(rows, width).contiguous(),
        targets=targets,
        response_positions=owner * width + flat.prompt[owner] - 1 + token_index,
        response_token_index=token_index,
        response_lengths=torch.bincount(owner, minlength=rows).tolist(),
        sample_indices=list(indices),
        rollout_logprobs=None if flat.rollout is None else flat.rollout[flat.policy],
    )


def packed_length(sequence_length: int, cp_size: int = 1, sp_size: int = 1) -> int:
    """A sequence's length in a packed micro-batch: padded to a multiple of 2*CP under context
    parallelism, times ``sp_size`` (the TP size) under sequence parallelism, which scatters the
    sequence dimension over the TP ranks. Megatron's convention: every sequence is padded, so its
    context-parallel chunks do not depend on which sequences share its micro-batch."""
    multiple = (2 * cp_size if cp_size > 1 else 1) * sp_size
    return -(-sequence_length // multiple) * multiple


def collate_packed(
    samples: Sequence[RolloutSample],
    indices: Sequence[int],
    cp_rank: int = 0,
    cp_size: int = 1,
    pad_id: int = 0,
    sp_size: int = 1,
) -> MicroBatch:
    """The padding-free (THD) :class:`MicroBatch` of ``samples[i] for i in indices`` on one CP rank.

    The sequences are concatenated into one row [1, T]; with context parallelism each is padded
    to :func:`packed_length` and only this rank's two chunks of it are kept
    (:func:`~megatron_zcpo.megatron.attention.context_parallel_positions`), so T = sum of padded
    lengths / CP; with sequence parallelism (``sp_size`` = the TP size) also a multiple of TP.
    ``packed_seq_params`` carries the global boundaries megatron's RoPE and the
    attention (TE's or :class:`~megatron_zcpo.megatron.attention.PackedCausalAttention`) use:
    ``cu_seqlens_*`` of the real tokens and, whenever there is padding, ``cu_seqlens_*_padded``;
    padding never holds a response position, so it never reaches a loss.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_zcpo.megatron.attention import context_parallel_position_of

    flat = _flatten(samples, indices)
    full = [packed_length(n, cp_size, sp_size) for n in flat.inputs]
    local = torch.tensor([f // cp_size for f in full], dtype=torch.long)
    # Every local token's sample and its index among that sample's local tokens.
    sample = torch.repeat_interleave(torch.arange(local.numel()), local)
    j = torch.arange(sample.numel()) - _starts(local)[sample]
    held = j  # global positions kept here: all of them, or this rank's two chunks of each sequence
    if cp_size > 1:
        held = context_parallel_position_of(
            j, (torch.tensor(full, dtype=torch.long) // (2 * cp_size))[sample], cp_rank, cp_size
        )
    tokens, targets = _shifted_pair(flat, sample, held, pad_id)
    first = (flat.prompt - 1)[sample]  # the position whose target is the first response token
    response_positions = torch.nonzero((held >= first) & (held < first + flat.response[sample])).reshape(-1)
    owner = sample[response_positions]
    token_index = held[response_positions] - first[response_positions]
    policy = flat.policy[_starts(flat.response)[owner] + token_index]  # tool tokens hold no response position
    response_positions, owner, token_index = response_positions[policy], owner[policy], token_index[policy]
    rollout = None
    if flat.rollout is not None:
        rollout = flat.rollout[_starts(flat.response)[owner] + token_index]
    actual, padded = [0, *itertools.accumulate(flat.inputs)], [0, *itertools.accumulate(full)]
    cu_actual = torch.tensor(actual, dtype=torch.int32)
    cu_padded = torch.tensor(padded, dtype=torch.int32) if cp_size > 1 or padded != actual else None
    return MicroBatch(
        tokens=tokens.unsqueeze(0),
        position_ids=held.unsqueeze(0),
        targets=targets.unsqueeze(0),
        response_positions=response_positions,
        response_token_index=token_index,
        response_lengths=torch.bincount(owner, minlength=local.numel()).tolist(),
        sample_indices=list(indices),
        rollout_logprobs=rollout,
        packed_seq_params=PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_actual,
            cu_seqlens_kv=cu_actual,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=max(full),
            max_seqlen_kv=max(full),
        ),
    )


@dataclass(frozen=True)
class MicroBatchLayout:
    """How this rank cuts samples into micro-batches.

    ``token_budget``: tokens per micro-batch before the context-parallel split
    (``train.micro_batch_tokens``); ``packing``: "thd" (padding-free packed rows) or "padded";
    ``whole_groups``: the algorithm needs every group inside one micro-batch; ``cp_rank`` /
    ``cp_size``: this rank's context-parallel place; ``sp_size``: the sequence-length multiple
    sequence parallelism needs (the TP size, else 1); ``equal_count``: every data-parallel rank gets
    as many micro-batches as the one with the most (:func:`pad_to_equal_count`; expert parallelism).
    """

    token_budget: int
    packing: str = "thd"
    whole_groups: bool = False
    cp_rank: int = 0
    cp_size: int = 1
    sp_size: int = 1
    equal_count: bool = False  # pad to the data-parallel group's largest count (expert parallelism)


def collate_micro_batches(
    samples: Sequence[RolloutSample], indices: Sequence[int], layout: MicroBatchLayout
) -> List[MicroBatch]:
    """This rank's micro-batches of ``samples[i] for i in indices`` under ``layout``, on the compute device.

    Deterministic in (samples, indices, layout): every pass that collates the same share sees the
    same micro-batches, so per-token statistics line up (on a CP rank: its chunks of each response).
    """
    units = units_of(indices, [s.group_id for s in samples], layout.whole_groups)
    device = compute_device()
    if layout.packing == "padded":
        lengths = [s.sequence_length for s in samples]
        collated = [
            collate(samples, chunk, sp_size=layout.sp_size).to(device)
            for chunk in pack_micro_batches(units, lengths, layout.token_budget)
        ]
    else:
        lengths = [packed_length(s.sequence_length, layout.cp_size, layout.sp_size) for s in samples]
        collated = [
            collate_packed(samples, chunk, layout.cp_rank, layout.cp_size, sp_size=layout.sp_size).to(device)
            for chunk in pack_micro_batches(units, lengths, layout.token_budget, padded=False)
        ]
    return pad_to_equal_count(collated, layout) if layout.equal_count else collated


# Expert parallelism: the EP group spans data-parallel ranks, and every MoE layer's token dispatch is
# an all-to-all in which each EP rank takes part once per micro-batch, forward and backward. Ranks
# pack their own samples into as many micro-batches as the token budget needs, which may differ; a
# rank with fewer would leave the others waiting in an all-to-all. So each rank pads its list to the
# group's largest count with padding micro-batches (one padding token, no sample, no response
# position): they run through the model and its all-to-alls and reach no loss or statistic (the
# passes skip their loss, :func:`is_padding`; the update backpropagates a zero).


def is_padding(micro_batch: MicroBatch) -> bool:
    """Whether ``micro_batch`` is a padding micro-batch (it holds no sample)."""
    return not micro_batch.sample_indices


def padding_micro_batch(layout: MicroBatchLayout) -> MicroBatch:
    """A micro-batch of one padding token (id 0; padded for CP/SP like any sequence) with no sample
    and no response position, in ``layout``'s packing."""
    filler = [RolloutSample([0], [0], group_id=-1, reward=0.0)]
    if layout.packing == "padded":
        micro_batch = collate(filler, [0], sp_size=layout.sp_size)
    else:
        micro_batch = collate_packed(filler, [0], layout.cp_rank, layout.cp_size, sp_size=layout.sp_size)
    empty = torch.zeros(0, dtype=torch.long)
    return dataclasses.replace(
        micro_batch,
        response_positions=empty,
        response_token_index=empty,
        response_lengths=[],
        sample_indices=[],
        rollout_logprobs=None,
    )


def pad_to_equal_count(micro_batches: List[MicroBatch], layout: MicroBatchLayout) -> List[MicroBatch]:
    """``micro_batches`` followed by padding micro-batches up to the largest count in the
    data-parallel x context-parallel group. Collective over that group: every rank calls it for
    the same pass."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    count = torch.tensor([len(micro_batches)], dtype=torch.long, device=compute_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
    missing = int(count) - len(micro_batches)
    return micro_batches + [padding_micro_batch(layout).to(compute_device())] * missing


class StepMicroBatches:
    """One rollout step's micro-batches on this rank: ``step_micro_batches(indices)`` collates each share once.

    The experience pass (all of this rank's samples), the update (each mini-batch's share; the same
    list with one mini-batch) and repeated gradient probes of a share get the same list back:
    nothing writes into a micro-batch. Lives as long as the step's :class:`RolloutStep`.
    """

    def __init__(self, samples: Sequence[RolloutSample], layout: MicroBatchLayout):
        self.samples = samples
        self.layout = layout
        self._collated: Dict[Tuple[int, ...], List[MicroBatch]] = {}

    def __call__(self, indices: Sequence[int]) -> List[MicroBatch]:
        """:func:`collate_micro_batches` of ``indices``, collated on the first call for them."""
        key = tuple(indices)
        if key not in self._collated:
            self._collated[key] = collate_micro_batches(self.samples, indices, self.layout)
        return self._collated[key]
