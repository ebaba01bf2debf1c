"""The whole-batch collation is bit-identical to the per-sample loop it replaced (kept here as the reference)."""

import random

import pytest
import torch

from megatron_zcpo.training.batch import MicroBatch, RolloutSample, collate, collate_packed, packed_length


# ----------------------------------------------------------------------------- the reference: the old loop
def _reference_positions(length, cp_rank, cp_size):
    if cp_size == 1:
        return torch.arange(length)
    chunk = length // (2 * cp_size)
    mirrored = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk), torch.arange(mirrored * chunk, (mirrored + 1) * chunk)]
    )


def _reference_sequence(sample, index):
    sequence = torch.cat(
        [torch.as_tensor(sample.prompt_ids, dtype=torch.long), torch.as_tensor(sample.response_ids, dtype=torch.long)]
    )
    start, length = len(sample.prompt_ids) - 1, len(sample.response_ids)
    rollout = None
    if sample.rollout_logprobs is not None:
        if len(sample.rollout_logprobs) != length:
            raise ValueError(
                f"sample {index}: {len(sample.rollout_logprobs)} rollout log-probs for {length} response tokens"
            )
        rollout = torch.as_tensor(sample.rollout_logprobs, dtype=torch.float32)
    return sequence[:-1], sequence[1:], start, length, rollout


def _reference_collate(samples, indices, pad_id=0, sp_size=1):
    rows = [_reference_sequence(samples[i], i) for i in indices]
    width = -(-max(inputs.numel() for inputs, *_ in rows) // sp_size) * sp_size
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions, token_index = [], []
    for row, (inputs, shifted, start, length, _) in enumerate(rows):
        tokens[row, : inputs.numel()] = inputs
        targets[row, : inputs.numel()] = shifted
        positions.append(row * width + torch.arange(start, start + length))
        token_index.append(torch.arange(length))
    rollout = [r for *_, r in rows]
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(width).unsqueeze(0).expand(len(rows), width).contiguous(),
        targets=targets,
        response_positions=torch.cat(positions),
        response_token_index=torch.cat(token_index),
        response_lengths=[length for *_, length, _ in rows],
        sample_indices=list(indices),
        rollout_logprobs=torch.cat(rollout) if all(r is not None for r in rollout) else None,
    )


def _reference_collate_packed(samples, indices, cp_rank=0, cp_size=1, pad_id=0, sp_size=1):
    from megatron.core.packed_seq_params import PackedSeqParams

    pieces, targets, positions, response_positions, token_index, lengths, rollout = [], [], [], [], [], [], []
    actual, padded, offset = [0], [0], 0
    for i in indices:
        inputs, shifted, start, length, logprobs = _reference_sequence(samples[i], i)
        full = packed_length(inputs.numel(), cp_size, sp_size)
        held = _reference_positions(full, cp_rank, cp_size)
        pad = full - inputs.numel()
        pieces.append(torch.cat([inputs, torch.full((pad,), pad_id, dtype=torch.long)])[held])
        targets.append(torch.cat([shifted, torch.full((pad,), pad_id, dtype=torch.long)])[held])
        positions.append(held)
        mine = torch.nonzero((held >= start) & (held < start + length)).reshape(-1)
        response_positions.append(offset + mine)
        token_index.append(held[mine] - start)
        lengths.append(int(mine.numel()))
        rollout.append(None if logprobs is None else logprobs[held[mine] - start])
        actual.append(actual[-1] + inputs.numel())
        padded.append(padded[-1] + full)
        offset += held.numel()
    cu_actual = torch.tensor(actual, dtype=torch.int32)
    cu_padded = torch.tensor(padded, dtype=torch.int32) if cp_size > 1 or padded != actual else None
    longest = max(b - a for a, b in zip(padded, padded[1:]))
    return MicroBatch(
        tokens=torch.cat(pieces).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        targets=torch.cat(targets).unsqueeze(0),
        response_positions=torch.cat(response_positions),
        response_token_index=torch.cat(token_index),
        response_lengths=lengths,
        sample_indices=list(indices),
        rollout_logprobs=torch.cat(rollout) if all(r is not None for r in rollout) else None,
        packed_seq_params=PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_actual,
            cu_seqlens_kv=cu_actual,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        ),
    )


# ----------------------------------------------------------------------------- comparison
def _assert_identical(name, got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    else:
        assert type(got) is type(want) and got == want, name


def _assert_same_micro_batch(got: MicroBatch, want: MicroBatch):
    for name in (
        "tokens",
        "position_ids",
        "targets",
        "response_positions",
        "response_token_index",
        "response_lengths",
        "sample_indices",
        "rollout_logprobs",
    ):
        _assert_identical(name, getattr(got, name), getattr(want, name))
    if want.packed_seq_params is None:
        assert got.packed_seq_params is None
        return
    for name in (
        "qkv_format",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded",
        "max_seqlen_q",
        "max_seqlen_kv",
        "local_cp_size",
        "cp_group",
    ):
        _assert_identical(
            f"packed_seq_params.{name}", getattr(got.packed_seq_params, name), getattr(want.packed_seq_params, name)
        )


def _random_samples(seed: int, count: int, rollout: str):
    """Samples of 0-12 prompt and 0-20 response tokens (edge lengths included), as lists or int32/float64
    tensors; ``rollout``: "all" log-probs, "none", or "some" (one sample without: None overall)."""
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        prompt = [rng.randrange(1000) for _ in range(rng.choice([0, 1, 1, 2, 5, 12]))]
        response = [rng.randrange(1000) for _ in range(rng.choice([0, 1, 3, 7, 20]))]
        logprobs = [-rng.random() * 5 for _ in response]
        if index % 3 == 1:  # the rollout broadcast's form: views of flat int32 / float32 tensors
            prompt, response = torch.tensor(prompt, dtype=torch.int32), torch.tensor(response, dtype=torch.int32)
            logprobs = torch.tensor(logprobs, dtype=torch.float64 if index % 2 else torch.float32)
        if rollout == "none" or (rollout == "some" and index == count // 2):
            logprobs = None
        samples.append(RolloutSample(prompt, response, group_id=index // 4, reward=0.0, rollout_logprobs=logprobs))
    return samples


def _chosen(samples, seed):
    rng = random.Random(seed + 100)
    # Shuffled, and never empty sequences only (the reference cannot size an all-empty batch either).
    indices = [i for i in rng.sample(range(len(samples)), len(samples)) if rng.random() < 0.8]
    return indices or [0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rollout", ["all", "none", "some"])
def test_packed_collate_matches_the_per_sample_loop(seed, rollout):
    samples = _random_samples(seed, 24, rollout)
    samples.append(
        RolloutSample(
            [7, 8, 9], [10, 11], group_id=99, reward=0.0, rollout_logprobs=None if rollout == "none" else [-0.5, -0.25]
        )
    )
    indices = _chosen(samples, seed) + [len(samples) - 1]  # at least one non-empty sequence
    for cp_size in (1, 2, 4):
        for sp_size in (1, 2):
            for cp_rank in range(cp_size):
                for pad_id in (0, 3):
                    _assert_same_micro_batch(
                        collate_packed(samples, indices, cp_rank, cp_size, pad_id=pad_id, sp_size=sp_size),
                        _reference_collate_packed(samples, indices, cp_rank, cp_size, pad_id=pad_id, sp_size=sp_size),
                    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rollout", ["all", "none", "some"])
def test_padded_collate_matches_the_per_sample_loop(seed, rollout):
    samples = _random_samples(seed, 24, rollout)
    indices = _chosen(samples, seed)
    for sp_size in (1, 2, 4):
        for pad_id in (0, 3):
            _assert_same_micro_batch(
                collate(samples, indices, pad_id=pad_id, sp_size=sp_size),
                _reference_collate(samples, indices, pad_id=pad_id, sp_size=sp_size),
            )


def test_mismatched_rollout_logprobs_name_the_first_bad_sample():
    samples = _random_samples(0, 6, "all")
    samples[4] = RolloutSample([1, 2], [3, 4, 5], group_id=0, reward=0.0, rollout_logprobs=[-1.0])
    samples[2] = RolloutSample([1], [3, 4], group_id=0, reward=0.0, rollout_logprobs=[-1.0, -2.0, -3.0])
    for build in (collate, collate_packed, _reference_collate, _reference_collate_packed):
        with pytest.raises(ValueError, match="^sample 4: 1 rollout log-probs for 3 response tokens$"):
            build(samples, [0, 4, 2])
        with pytest.raises(ValueError, match="^sample 2: 3 rollout log-probs for 2 response tokens$"):
            build(samples, [2, 4])


def test_an_empty_micro_batch_is_refused():
    for build in (collate, collate_packed):
        with pytest.raises(ValueError, match="at least one sample"):
            build(_random_samples(0, 2, "all"), [])
