"""Parallel ops: vocab-parallel token statistics over tensor-parallel process groups (no model)."""

from megatron_zcpo.ops.token_stats import MASKED_LOGIT, TokenStats, fused_token_stats, vocab_parallel_token_stats

__all__ = ["MASKED_LOGIT", "TokenStats", "fused_token_stats", "vocab_parallel_token_stats"]
