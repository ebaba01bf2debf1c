"""Megatron-core integration: platform layer, setup, model building, experience pass, train step, checkpoints."""
