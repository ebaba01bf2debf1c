"""FP8 rollout weights: modelopt's export layout, and the embedded engine's numerics vs modelopt fake quantisation."""

import copy

import modelopt.torch.quantization as mtq  # the dev extra installs it: a broken install fails here, never skips
import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.embedded import EmbeddedEngine, build_hf_causal_lm
from megatron_zcpo.rollout.engine import SamplingParams
from megatron_zcpo.rollout.quantization import (
    fake_quantize_fp8_hf_weights,
    is_fp8_quantized,
    quantize_fp8_hf_weights,
)

MODEL = ModelConfig(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(5)
    model = build_hf_causal_lm(MODEL)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def test_stream_layout_matches_modelopt_export(policy):
    from modelopt.torch.export.quant_utils import to_quantized_weight

    stream = list(policy.named_parameters()) + [("model.layers.7.mlp.down_proj.weight", torch.zeros(64, 128))]
    out = iter(quantize_fp8_hf_weights(stream))
    for name, tensor in stream:
        out_name, quantized = next(out)
        assert out_name == name
        if not is_fp8_quantized(name):
            assert quantized is tensor
            continue
        scale_name, scale = next(out)
        assert scale_name == name + "_scale"
        assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == tensor.shape
        assert scale.dtype == torch.float32 and scale.dim() == 0
        amax = tensor.abs().max()
        assert scale.item() == ((amax / 448.0).item() if amax > 0 else 1.0)
        exported = to_quantized_weight(tensor.float(), scale, "fp8")  # modelopt's HF exporter
        assert torch.equal(quantized.view(torch.uint8), exported.view(torch.uint8)), name
    assert next(out, None) is None
    assert sum(is_fp8_quantized(n) for n, _ in stream) == 2 * 7 + 1
    assert not any(
        is_fp8_quantized(n)
        for n in (
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.0.self_attn.q_proj.bias",
        )
    )


def test_fp8_engine_computes_like_modelopt_fake_quantisation(policy):
    prompts = [[3, 9, 27, 81], [5, 7], [11, 13, 17]]
    config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    config["quant_cfg"].append({"quantizer_name": "*input_quantizer", "enable": False})  # weight-only
    reference = mtq.quantize(
        copy.deepcopy(policy), config, forward_loop=lambda m: m(input_ids=torch.tensor([prompts[0]]))
    )
    with EmbeddedEngine(MODEL, quantization="fp8") as engine:
        engine.update_weights(policy.named_parameters(), version=1)
        loaded = dict(engine.model.named_parameters())
        for name, module in reference.named_modules():
            if hasattr(module, "weight_quantizer") and module.weight_quantizer.is_enabled:
                with torch.no_grad():
                    fake = module.weight_quantizer(module.weight)
                # Same FP8 codes; modelopt rescales by 1 / (448 / amax), the checkpoint format (and
                # we) by amax / 448: the reconstructions may differ in the last fp32 bit.
                torch.testing.assert_close(loaded[name + ".weight"], fake, rtol=2**-22, atol=0, msg=name)
        assert torch.equal(
            loaded["model.embed_tokens.weight"], dict(policy.named_parameters())["model.embed_tokens.weight"]
        )
        temperature = 0.8
        results = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=8, seed=0))
    mismatch = []
    for prompt, [completion] in zip(prompts, results):
        sequence = torch.tensor([prompt + completion.output_ids])
        targets = torch.tensor(completion.output_ids)[:, None]
        with torch.no_grad():
            quantized_logits = reference(input_ids=sequence).logits[0, len(prompt) - 1 : -1].double()
            full_logits = policy(input_ids=sequence).logits[0, len(prompt) - 1 : -1].double()
        expected = torch.log_softmax(quantized_logits / temperature, -1).gather(-1, targets)[:, 0]
        got = torch.tensor(completion.output_logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        mismatch.append(got - torch.log_softmax(full_logits / temperature, -1).gather(-1, targets)[:, 0])
    # The rollout policy is not the trained one: this gap is what importance sampling corrects.
    gap = torch.cat(mismatch).abs()
    assert 1e-4 < gap.max().item() < 0.5
    print(f"fp8 rollout vs full precision: mean |log-prob gap| {gap.mean().item():.2e}, max {gap.max().item():.2e}")


def test_fake_quantised_stream_keeps_names_and_dtypes(policy):
    stream = [(n, p.detach().to(torch.bfloat16)) for n, p in policy.named_parameters()]
    out = list(fake_quantize_fp8_hf_weights(stream))
    assert [n for n, _ in out] == [n for n, _ in stream]
    for (name, before), (_, after) in zip(stream, out):
        assert after.dtype == torch.bfloat16 and after.shape == before.shape
        if not is_fp8_quantized(name):
            assert after is before
