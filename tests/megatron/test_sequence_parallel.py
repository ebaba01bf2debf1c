"""Sequence parallelism on CPUs: padding to a multiple of TP, the local spec's norms, equality with TP1."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases
from tests.training.test_trainer_layouts import _assert_same_step


@pytest.fixture(scope="module")
def single_thd(weights):
    return run_distributed(trainer_cases.one_update, 1, 1, 1, *weights)[0]


def test_packed_sequences_are_padded_to_a_multiple_of_tp_times_2cp():
    from megatron_zcpo.training.batch import collate, collate_packed

    samples = trainer_cases.rollout()
    indices = [0, 1, 2, 3]
    real = torch.tensor([samples[i].sequence_length for i in indices])
    for cp_size, sp_size in ((1, 2), (1, 4), (2, 2)):
        multiple = sp_size * (2 * cp_size if cp_size > 1 else 1)
        batches = [collate_packed(samples, indices, rank, cp_size, sp_size=sp_size) for rank in range(cp_size)]
        params = batches[0].packed_seq_params
        lengths = params.cu_seqlens_q_padded.diff()
        assert torch.all(lengths % multiple == 0) and torch.all(lengths - real < multiple) and torch.any(lengths > real)
        assert torch.equal(params.cu_seqlens_q.diff(), real.to(torch.int32))  # the real tokens, unpadded
        for mb in batches:
            assert mb.tokens.shape[1] == int(lengths.sum()) // cp_size and mb.tokens.shape[1] % sp_size == 0
        # The padding holds no response position: the response tokens are the same ones.
        assert sum(mb.response_positions.numel() for mb in batches) == sum(
            len(samples[i].response_ids) for i in indices
        )
        # A sequence's context-parallel chunks do not depend on its micro-batch mates.
        alone = collate_packed(samples, [indices[-1]], cp_size - 1, cp_size, sp_size=sp_size)
        together = batches[-1]
        tail = together.tokens.shape[1] - alone.tokens.shape[1]
        assert torch.equal(together.tokens[0, tail:], alone.tokens[0])
    rows = collate(samples, indices, sp_size=4)
    assert rows.tokens.shape[1] % 4 == 0 and rows.tokens.shape[1] - 4 < int(real.max())


def test_local_spec_norms_are_sequence_parallel():
    norms = run_distributed(_norm_flags, 2)
    for flags in norms:
        # input, pre-MLP (per layer) and final norms, all marked for megatron's TP all-reduce.
        assert len(flags) == 2 * trainer_cases.MODEL.num_layers + 1 and all(flags.values()), flags


def _norm_flags(rank, world):
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    setup_megatron(tensor_parallel=2, seed=1)
    model = build_gpt_model(
        trainer_cases.MODEL, transformer_config(trainer_cases.MODEL, tensor_parallel=2, sequence_parallel=True)
    )
    return {name: getattr(p, "sequence_parallel", False) for name, p in model.named_parameters() if "layernorm" in name}


SP_LAYOUTS = [
    pytest.param(2, 1, 1, "thd", 2, id="TP2-SP-thd"),
    pytest.param(2, 1, 1, "padded", 2, id="TP2-SP-padded"),
    pytest.param(2, 2, 1, "thd", 4, id="TP2-SP-PP2"),
    pytest.param(2, 1, 2, "thd", 4, id="TP2-SP-CP2"),
]


@pytest.mark.parametrize("tp,pp,cp,packing,world", SP_LAYOUTS)
def test_sequence_parallel_matches_single_process(single_thd, weights, tp, pp, cp, packing, world):
    """TP2 with sequence parallelism: same coefficients, losses, grad norm and parameters as TP1."""
    results = run_distributed(
        trainer_cases.one_update, world, tp, pp, *weights, cp=cp, packing=packing, sequence_parallel=True
    )
    _assert_same_step(results, single_thd)


def _fused_head_gradients(rank, world):
    """Gradients of sum(a logprob + b entropy + c kl) through the hidden-state head under SP at TP=world:
    this rank's sequence chunk of the final hidden states [S/TP, 1, H] and its vocabulary shard of the weight."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.pipeline import install_hidden_state_head
    from megatron_zcpo.ops import fused_token_stats

    setup_megatron(tensor_parallel=world, seed=1)
    model = build_gpt_model(
        trainer_cases.MODEL, transformer_config(trainer_cases.MODEL, tensor_parallel=world, sequence_parallel=world > 1)
    )
    install_hidden_state_head(model)
    hidden, ref_hidden, weight, ref_weight, targets, coefficients = _head_inputs()
    local = hidden.chunk(world)[rank].clone().requires_grad_()
    shard = weight.chunk(world)[rank].clone().requires_grad_()
    gathered, _ = model.output_layer(local)  # [S, 1, H]: megatron's all-gather of the sequence
    stats = fused_token_stats(
        gathered.reshape(-1, hidden.shape[-1]),
        shard,
        targets,
        ref_hidden.reshape(-1, hidden.shape[-1]),
        ref_weight.chunk(world)[rank],
        group=ps.get_tensor_model_parallel_group(),
        vocab_size=trainer_cases.MODEL.vocab_size,
        chunk_size=3,
    )
    (coefficients * torch.stack([stats.logprob, stats.entropy, stats.kl])).sum().backward()
    return local.grad, shard.grad


def _head_inputs(tokens=10):
    from megatron_zcpo.megatron.model import padded_vocab_size

    gen = torch.Generator().manual_seed(4)
    hidden_size, vocab = trainer_cases.MODEL.hidden_size, trainer_cases.MODEL.vocab_size
    padded = padded_vocab_size(vocab, 2)
    hidden = torch.randn(tokens, 1, hidden_size, generator=gen, dtype=torch.float64)
    ref_hidden = hidden + 0.3 * torch.randn(tokens, 1, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(padded, hidden_size, generator=gen, dtype=torch.float64) * 0.3
    ref_weight = weight + 0.1 * torch.randn(padded, hidden_size, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return hidden, ref_hidden, weight, ref_weight, targets, torch.randn(3, tokens, generator=gen, dtype=torch.float64)


def test_fused_kl_hidden_gradient_under_sequence_parallelism():
    """The head all-gathers the sequence; the fused op sums the vocabulary shards' hidden gradients over
    TP, so the gather's backward must only split (not reduce-scatter again): float64 reference."""
    hidden, ref_hidden, weight, ref_weight, targets, coefficients = _head_inputs()
    vocab = trainer_cases.MODEL.vocab_size
    h = hidden.reshape(-1, hidden.shape[-1]).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp = (h @ w[:vocab].T).log_softmax(-1)
    logq = (ref_hidden.reshape(-1, hidden.shape[-1]) @ ref_weight[:vocab].T).log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    logprob = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (coefficients * torch.stack([logprob, entropy, kl])).sum().backward()
    per_rank = run_distributed(_fused_head_gradients, 2)
    torch.testing.assert_close(torch.cat([g for g, _ in per_rank]).reshape(h.shape), h.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.cat([g for _, g in per_rank]), w.grad, rtol=1e-9, atol=1e-12)
    assert h.grad.abs().max() > 1e-3
