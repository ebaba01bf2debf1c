"""Rollout engines: the engine interface, the embedded CPU engine, dynamic sampling, evaluation, overlap; SGLang in rollout/sglang/, weight transports in rollout/sglang/update_weight/."""
