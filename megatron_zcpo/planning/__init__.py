"""The planner: memory per GPU, step time, decode rates and MoE costs of a run before it starts (no process groups, no GPU)."""
