"""Rollout engines: the engine interface, SGLang client and server launch, embedded CPU engine, weight sync."""
