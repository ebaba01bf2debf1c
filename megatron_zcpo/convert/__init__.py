"""Hugging Face <-> Megatron name and layout mapping (checkpoint tools and the rollout weight push)."""
