"""Tiny random DeepSeek-V3-architecture checkpoints built with transformers' own DeepseekV3ForCausalLM (tests, GPU checks)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=4096,
    first_k_dense_replace=1,
    num_mtp_layers=0,
)
YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}
# name -> (DeepseekV3Config fields over TINY, stored dtype)
ARCHITECTURES = {
    # DeepSeek-V3 as released: query latent, YaRN with its softmax-scale correction, 4 groups of 2
    # experts of which 2 are eligible (top-4 = 2 x topk_group), one shared expert, layer 0 dense
    "dsv3-yarn-groups": (
        dict(
            vocab_size=300,
            num_hidden_layers=3,
            q_lora_rank=32,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
        torch.float32,
    ),
    # Moonlight's shape: no query latent, plain RoPE, no groups, two shared experts, stored in bf16
    "moonlight-bf16": (
        dict(
            vocab_size=260,
            num_hidden_layers=2,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=2.446,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        ),
        torch.bfloat16,
    ),
}


def make_hf_model(directory: Path, fields: dict, dtype: torch.dtype, seed: int) -> None:
    """Save a random DeepseekV3ForCausalLM of ``TINY`` and ``fields`` in ``dtype`` to ``directory`` (100 KB
    shards): every tensor random (norms near 1; a swapped expert, head, norm or bias changes the logits),
    well separated router scores (no near-ties in the top-k), the correction bias float32 as in DeepSeek's
    bf16 checkpoints."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY, **copy.deepcopy(fields)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_((0.5 if name.endswith("mlp.gate.weight") else 0.05) * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    model.to(dtype)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.data = buffer.data.float()
    model.save_pretrained(directory, max_shard_size="100KB")
