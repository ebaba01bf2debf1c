"""Checkpoints: atomic save and exact resume (megatron-core dist_checkpointing), manifests, the checks before a resume."""
