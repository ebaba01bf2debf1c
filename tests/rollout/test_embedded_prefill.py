"""Embedded engine: the n samples of a prompt share one prefill, with the same results as separate prefills."""

import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.embedded import EmbeddedEngine, build_hf_causal_lm
from megatron_zcpo.rollout.engine import SamplingParams

MODEL = ModelConfig(
    vocab_size=500,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.mark.parametrize("max_batch_size", [256, 6])  # 6: batches split a prompt's samples
def test_shared_prefill_equals_separate_prefills(max_batch_size):
    torch.manual_seed(0)
    policy = build_hf_causal_lm(MODEL)
    with torch.no_grad():
        for param in policy.parameters():
            param.normal_(0.0, 0.08)
    engine = EmbeddedEngine(MODEL, max_batch_size=max_batch_size)
    engine.update_weights(policy.named_parameters(), version=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, MODEL.vocab_size, (int(n),), generator=gen).tolist() for n in (3, 9, 5, 12)]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    n = 4
    shared = engine.generate(prompts, params, n=n)
    # The same rows with every sample given as its own prompt: one prefill per row, same batches
    # and random draws.
    separate = engine.generate([p for p in prompts for _ in range(n)], params, n=1)
    shared_rows = [c for group in shared for c in group]
    separate_rows = [group[0] for group in separate]
    assert [c.output_ids for c in shared_rows] == [c.output_ids for c in separate_rows]
    assert [c.prompt_ids for c in shared_rows] == [c.prompt_ids for c in separate_rows]
    for a, b in zip(shared_rows, separate_rows):
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)
    assert len({tuple(c.output_ids) for c in shared[1]}) > 1  # the samples of a prompt still differ
