"""FLOPs of a forward pass per token, and the peak they run against: shared by the decode roofline and the step model."""

from __future__ import annotations

from megatron_zcpo.megatron.model import ModelConfig

H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet, dense BF16 tensor-core peak


def forward_flops_per_token(model: ModelConfig, sequence_length: float) -> float:
    """FLOPs of one forward pass per token of a causal sequence of ``sequence_length`` tokens."""
    dense = model.num_active_parameters - model.vocab_size * model.hidden_size  # the embedding is a lookup
    if model.tie_word_embeddings:
        dense += model.vocab_size * model.hidden_size  # the tied weight still runs as output layer
    attention = 4 * model.num_layers * model.num_attention_heads * model.kv_channels * sequence_length / 2
    return 2 * dense + attention
