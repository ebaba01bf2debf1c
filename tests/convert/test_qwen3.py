"""Qwen3 dense: config mapping both ways, refusals of what we do not convert, parameter counts, push names.

Logits against transformers' Qwen3ForCausalLM at TP1/TP2/PP2 are the Qwen3 cases of
tests/test_convert.py; the embedded engine's log-probs are in tests/test_rollout_embedded.py.
"""

import pytest
import torch

from megatron_zcpo.convert import mapping
from megatron_zcpo.megatron.model import ModelConfig, padded_vocab_size
from megatron_zcpo.planning.planner import Layout, stage_parameters


def _qwen3_config(**changes) -> dict:
    """config.json of Qwen3-4B (Hugging Face hub, transformers>=5 style), with ``changes``."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 36,
        "dtype": "bfloat16",
        "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
    }
    config.update(changes)
    return config


QWEN3_32B = dict(
    hidden_size=5120,
    intermediate_size=25600,
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
)


def _transformers_parameter_count(config: dict) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")}
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Config(**fields)).parameters())


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, 4_022_468_096),  # Qwen3-4B: hidden 2560, 32 heads of 128 (not 80), tied
        (QWEN3_32B, 32_762_123_264),  # Qwen3-32B: the safetensors index total_size / 2 (bf16)
    ],
)
def test_qwen3_architecture_and_parameter_counts(changes, expected):
    config = _qwen3_config(**changes)
    model = mapping.model_config_from_hf(config)
    assert (model.family, model.qk_layernorm, model.qkv_bias, model.head_dim) == ("qwen3", True, False, 128)
    assert model.head_dim != model.hidden_size // model.num_attention_heads
    assert model.num_parameters == expected == _transformers_parameter_count(config)
    # The planner holds the same parameters at TP1 (151936 rows need no padding) ...
    assert stage_parameters(model, Layout(), "first") == expected
    # ... and at TP8 PP2 the ranks sum to the model plus the TP replicas of every norm (q/k norms
    # included) and the padding rows.
    tp, h, d = 8, model.hidden_size, model.head_dim
    layout = Layout(tensor_parallel=tp, pipeline_parallel=2)
    replicated = (2 * h + 2 * d) * model.num_layers + h
    padding_rows = padded_vocab_size(model.vocab_size, tp) - model.vocab_size
    tied_copy = model.vocab_size * h if model.tie_word_embeddings else 0  # the last stage's own output layer
    summed = tp * (stage_parameters(model, layout, "first") + stage_parameters(model, layout, "last"))
    assert summed == expected + (tp - 1) * replicated + tied_copy + 2 * padding_rows * h


def test_qwen3_config_round_trips_in_both_rope_styles():
    v5 = _qwen3_config()
    legacy = {key: value for key, value in v5.items() if key not in ("rope_parameters", "dtype")}
    legacy.update(rope_theta=5000000.0, rope_scaling=None, torch_dtype="bfloat16")
    model = mapping.model_config_from_hf(v5)
    assert model == mapping.model_config_from_hf(legacy)
    assert mapping.hf_config_from_model_config(model, base=v5) == v5
    assert mapping.hf_config_from_model_config(model, base=legacy) == legacy
    fresh = mapping.hf_config_from_model_config(model)
    assert (fresh["architectures"], fresh["head_dim"], fresh["attention_bias"]) == (["Qwen3ForCausalLM"], 128, False)
    assert mapping.model_config_from_hf(fresh) == model
    # A sliding-window size that is not enabled (Qwen3's released configs carry one) converts.
    assert mapping.model_config_from_hf(_qwen3_config(sliding_window=32768)) == model


@pytest.mark.parametrize(
    "changes, named",
    [
        (
            dict(num_experts=8),
            "mixture-of-experts",
        ),  # Qwen3-MoE converts as qwen3_moe (tests/convert/test_convert_moe.py)
        (dict(architectures=["Qwen3MoeForCausalLM"]), "Qwen3ForCausalLM"),
        (dict(architectures=["Qwen2ForCausalLM"]), "Qwen3ForCausalLM"),
        (dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
        (dict(layer_types=["full_attention"] * 35 + ["sliding_attention"]), "layer_types"),
        (
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                    "rope_theta": 1e6,
                }
            ),
            "yarn",
        ),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), "dynamic"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), "linear"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(head_dim=None), "head_dim"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(num_key_value_heads=5), "num_key_value_heads"),
    ],
)
def test_unsupported_qwen3_fields_are_refused_by_name(changes, named):
    with pytest.raises((KeyError, ValueError), match=named):
        mapping.model_config_from_hf(_qwen3_config(**changes))


def test_qk_norm_must_match_the_family_when_writing_a_config():
    with pytest.raises(ValueError, match="qk_layernorm"):
        mapping.hf_config_from_model_config(ModelConfig(family="qwen3", qk_layernorm=False))
    with pytest.raises(ValueError, match="qk_layernorm"):
        mapping.hf_config_from_model_config(ModelConfig(family="llama", qk_layernorm=True))
    with pytest.raises(ValueError, match="qkv_bias"):
        mapping.hf_config_from_model_config(ModelConfig(family="qwen3", qkv_bias=True))


def test_qwen3_tensor_names_shapes_and_push_names():
    model = ModelConfig(
        family="qwen3",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    names = mapping.megatron_tensor_names(model)
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in names
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in names
    assert not any(name.endswith(".bias") for name in names)
    assert mapping.megatron_tensor_shape("decoder.layers.0.self_attention.linear_qkv.weight", model) == (
        (4 + 4) * 32,
        64,
    )
    # The weight push streams exactly the Hugging Face names (SGLang / the embedded engine load them).
    meta = ((name, torch.empty(mapping.megatron_tensor_shape(name, model), device="meta")) for name in names)
    pushed = dict(mapping.megatron_to_hf_stream(meta, model))
    assert sorted(pushed) == sorted(mapping.hf_tensor_names(model))
    assert pushed["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert pushed["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    assert pushed["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    # A Qwen2 model has no q/k norms: naming one is an error, not a silent drop.
    qwen2 = ModelConfig(
        family="qwen2",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(KeyError, match="q_layernorm"):
        mapping.megatron_to_hf_tensors("decoder.layers.0.self_attention.q_layernorm.weight", torch.ones(16), qwen2)
