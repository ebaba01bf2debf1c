"""Megatron-core integration: the CPU platform layer, setup, model building, attention, pipeline schedules, weights."""
