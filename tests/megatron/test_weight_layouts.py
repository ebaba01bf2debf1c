"""TP shards of the fused SwiGLU fc1 and QKV follow megatron's convention, not ``partition_stride``."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases

TOKENS = torch.randint(0, trainer_cases.MODEL.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))


def _load_with_stride_one(rank, world, weights):
    """Load ``weights`` at TP=world with every partition_stride forced to 1 (as TE may leave it)."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.convert.verify import megatron_logits
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import iter_global_tensors, load_global_state_dict

    setup_megatron(tensor_parallel=world, seed=1)
    model = build_gpt_model(trainer_cases.MODEL, transformer_config(trainer_cases.MODEL, tensor_parallel=world))
    for param in model.parameters():
        param.partition_stride = 1
    load_global_state_dict(model, weights)
    layer = model.decoder.layers[0]
    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "fc1": layer.mlp.linear_fc1.weight.detach().clone(),
        "qkv": layer.self_attention.linear_qkv.weight.detach().clone(),
        "logits": megatron_logits(model, TOKENS),
        "pushed": {
            name: t.clone() for name, t in megatron_to_hf_stream(iter_global_tensors(model), trainer_cases.MODEL)
        },
    }


def test_stride_one_params_still_load_and_push_megatrons_layout(weights):
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream

    policy = weights[0]
    single = run_distributed(_load_with_stride_one, 1, policy)[0]
    per_rank = run_distributed(_load_with_stride_one, 2, policy)
    model = trainer_cases.MODEL
    fc1, qkv = (
        policy["decoder.layers.0.mlp.linear_fc1.weight"],
        policy["decoder.layers.0.self_attention.linear_qkv.weight"],
    )
    gate, up = fc1.chunk(2)
    expected_push = dict(megatron_to_hf_stream(policy.items(), model))
    for result in per_rank:
        r = result["tp_rank"]
        torch.testing.assert_close(result["fc1"], torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]), rtol=0, atol=0)
        # QKV: rank r holds whole query groups, a contiguous slice of the per-group interleaved layout.
        torch.testing.assert_close(result["qkv"], qkv.chunk(2)[r], rtol=0, atol=0)
        torch.testing.assert_close(result["logits"], single["logits"], rtol=1e-5, atol=1e-5)
        assert result["pushed"].keys() == expected_push.keys()
        for name, tensor in expected_push.items():
            torch.testing.assert_close(result["pushed"][name], tensor, rtol=0, atol=0, msg=name)
    assert single["logits"].abs().max() > 0


@pytest.mark.parametrize(
    "name,blocks",
    [
        ("decoder.layers.3.mlp.linear_fc1.weight", 2),
        ("decoder.layers.3.mlp.linear_fc1.bias", 2),
        ("decoder.layers.3.self_attention.linear_qkv.weight", 1),
        ("decoder.layers.3.mlp.linear_fc2.weight", 1),
    ],
)
def test_tp_blocks_come_from_the_config(name, blocks):
    from types import SimpleNamespace

    from megatron_zcpo.megatron.weights import tp_blocks

    assert tp_blocks(name, SimpleNamespace(gated_linear_unit=True)) == blocks
    assert tp_blocks(name, SimpleNamespace(gated_linear_unit=False)) == 1
