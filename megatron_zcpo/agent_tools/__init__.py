"""Tools a multi-turn rollout can call: the registry, Python-function tools and the sandboxed code tool."""
