"""Architectures of the models we ship examples for, as their public ``config.json`` fields, so
``zcpo plan`` can plan a 32B/70B (or 30B/235B/671B mixture-of-experts) run before anything is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

from megatron_zcpo.convert.hf_checkpoint import read_hf_config
from megatron_zcpo.convert.mapping import model_config_from_hf
from megatron_zcpo.megatron.model import ModelConfig

_QWEN25 = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 152064,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}
_QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}

# Qwen3 mixture-of-experts: 128 experts, 8 per token, renormalised; every layer sparse.
_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}

# The architecture fields of each model's config.json on the Hugging Face hub (weights-free).
_LLAMA31 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3; DeepSeek-R1 has the same architecture): 671B
# parameters, 37B active; its released weights are blockwise FP8 (megatron_zcpo/convert/fp8.py).
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "num_nextn_predict_layers": 1,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

HF_CONFIGS: Dict[str, dict] = {
    "Qwen2.5-7B": dict(
        _QWEN25,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
    ),
    "Qwen2.5-32B": dict(
        _QWEN25,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "Qwen2.5-72B": dict(
        _QWEN25,
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "Llama-3.1-8B": dict(
        _LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32
    ),
    "Llama-3.1-70B": dict(
        _LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64
    ),
    "Llama-3.3-70B": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
    },
    # The calibration anchors of the step-time model (benchmarks/RESULTS.md): NeMo-RL's and verl's
    # published runs. Llama 3.1 70B is Llama 3.3 70B's architecture.
    "Qwen3-32B": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "Qwen3-8B": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "Qwen3-4B": dict(_QWEN3, max_position_embeddings=40960, rope_theta=1000000.0),
    # the long-context example's model (examples/qwen3-4b-long-context-zcpo): the same layers, longer RoPE
    "Qwen3-4B-Thinking-2507": dict(_QWEN3, max_position_embeddings=262144, rope_theta=5000000.0),
    "Qwen3-30B-A3B": dict(
        _QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
    ),
    "Qwen3-235B-A22B": dict(
        _QWEN3_MOE,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
    ),
    "DeepSeek-V3": _DEEPSEEK_V3,
    # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture at 1.04T parameters (32B active): 384
    # experts, one dense layer, 64 heads, no expert groups, no multi-token prediction
    "Kimi-K2": dict(
        _DEEPSEEK_V3,
        model_type="kimi_k2",
        vocab_size=163840,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=384,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        max_position_embeddings=131072,
        rope_theta=50000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        num_nextn_predict_layers=0,
    ),
    # moonshotai/Moonlight-16B-A3B: the same architecture small (16B, 3B active; no query latent,
    # plain RoPE, two shared experts): a first run of the DeepSeek-V3 path on one node
    "Moonlight-16B-A3B": dict(
        _DEEPSEEK_V3,
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=None,
        num_nextn_predict_layers=0,
    ),
}


def preset_names() -> list:
    """The names :func:`preset_model_config` accepts, e.g. ``["Llama-3.3-70B", "Qwen2.5-32B", ...]``."""
    return sorted(HF_CONFIGS)


def preset_model_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` (case-insensitive; an ``-Instruct`` suffix is
    accepted: same architecture). Raises ``ValueError`` listing the presets on an unknown name."""
    wanted = name.lower().removesuffix("-instruct")
    for preset, config in HF_CONFIGS.items():
        if preset.lower() == wanted:
            return model_config_from_hf(config)
    raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")


def model_config_from_json(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` file (or a directory holding one)."""
    if Path(path).is_dir():
        return model_config_from_hf(read_hf_config(path))
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found: give a Hugging Face config.json (or its directory)")
    with open(path) as handle:
        return model_config_from_hf(json.load(handle))
