"""Micro-batch construction: padded rows, padding-free THD packing, context-parallel chunks."""

import pytest
import torch

from megatron_zcpo.megatron.attention import context_parallel_positions
from megatron_zcpo.training.batch import RolloutSample, collate, collate_packed, pack_micro_batches, packed_length


def _samples():
    return [
        RolloutSample(
            [1, 2, 3], [4, 5, 6, 7, 8], group_id=0, reward=1.0, rollout_logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5]
        ),
        RolloutSample([9], [10, 11], group_id=0, reward=0.0, rollout_logprobs=[-1.0, -2.0]),
        RolloutSample([12, 13, 14, 15, 16, 17, 18], [19], group_id=1, reward=1.0, rollout_logprobs=[-3.0]),
    ]


def _response_view(mb, samples):
    """{sample: {response token index: (target, rollout log-prob)}} read back through the micro-batch."""
    targets = mb.targets.reshape(-1)[mb.response_positions]
    view, offset = {}, 0
    for index, length in zip(mb.sample_indices, mb.response_lengths):
        span = slice(offset, offset + length)
        view[index] = {
            int(t): (int(y), float(r))
            for t, y, r in zip(mb.response_token_index[span], targets[span], mb.rollout_logprobs[span])
        }
        offset += length
    return view


def _expected(samples, indices):
    return {
        i: {
            t: (y, float(torch.tensor(r, dtype=torch.float32)))
            for t, (y, r) in enumerate(zip(samples[i].response_ids, samples[i].rollout_logprobs))
        }
        for i in indices
    }


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_context_parallel_positions_partition_the_sequence(cp):
    length = 2 * cp * 5
    held = [context_parallel_positions(length, rank, cp) for rank in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(length))
    if cp > 1:  # rank r holds chunks r and 2cp-1-r: every rank gets the same causal work
        chunk = length // (2 * cp)
        assert held[0][:chunk].tolist() == list(range(chunk))
        assert held[0][chunk:].tolist() == list(range(length - chunk, length))
        with pytest.raises(ValueError, match="multiple of 2\\*CP"):
            context_parallel_positions(length + 1, 0, cp)


def test_padded_collate_reads_back_every_response_token():
    samples = _samples()
    mb = collate(samples, [0, 1, 2])
    assert mb.tokens.shape == (3, 7) and mb.packed_seq_params is None
    assert _response_view(mb, samples) == _expected(samples, [0, 1, 2])


def test_packed_collate_concatenates_without_padding():
    samples = _samples()
    mb = collate_packed(samples, [2, 0])
    assert mb.tokens.shape == (1, 7 + 7)
    assert mb.tokens[0].tolist() == [12, 13, 14, 15, 16, 17, 18, 1, 2, 3, 4, 5, 6, 7]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 7, 14]
    assert mb.packed_seq_params.cu_seqlens_q_padded is None and mb.packed_seq_params.max_seqlen_q == 7
    assert _response_view(mb, samples) == _expected(samples, [2, 0])


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_ranks_together_hold_every_response_token_once(cp):
    samples = _samples()
    indices = [0, 1, 2]
    merged = {i: {} for i in indices}
    for rank in range(cp):
        mb = collate_packed(samples, indices, rank, cp)
        padded = [packed_length(samples[i].sequence_length, cp) for i in indices]
        assert mb.tokens.shape == (1, sum(padded) // cp)
        assert mb.packed_seq_params.cu_seqlens_q_padded.tolist() == [0] + torch.tensor(padded).cumsum(0).tolist()
        assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 7, 9, 16]
        for index, tokens in _response_view(mb, samples).items():
            assert not set(tokens) & set(merged[index])
            merged[index].update(tokens)
    assert merged == _expected(samples, indices)


def test_pack_micro_batches_budget_counts_padding_or_tokens():
    lengths = [10, 3, 3, 3, 9]
    units = [[i] for i in range(5)]
    padded = pack_micro_batches(units, lengths, 20)
    assert padded == [[0, 4], [1, 2, 3]]  # 2 rows x 10 and 3 rows x 3 padded tokens
    packed = pack_micro_batches(units, lengths, 20, padded=False)
    assert packed == [[0, 4], [1, 2, 3]]
    assert pack_micro_batches(units, lengths, 22, padded=False) == [[0, 4, 1], [2, 3]]
    assert pack_micro_batches(units, lengths, 22) == [[0, 4], [1, 2, 3]]  # a third row would cost 30
    with pytest.raises(ValueError, match="token_budget"):
        pack_micro_batches(units, lengths, 0)


def test_rollout_logprob_count_mismatch_is_named():
    bad = RolloutSample([1, 2], [3, 4], group_id=0, reward=1.0, rollout_logprobs=[-1.0])
    with pytest.raises(ValueError, match="sample 0: 1 rollout log-probs for 2 response tokens"):
        collate_packed([bad], [0])


def test_micro_batch_to_moves_model_inputs():
    mb = collate_packed(_samples(), [0, 1], 1, 2).to("cpu")
    assert mb.packed_seq_params.cu_seqlens_kv_padded.dtype == torch.int32
    assert mb.tokens.device.type == "cpu"
