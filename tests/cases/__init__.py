"""Shared multi-rank cases (module-level functions, so spawned ranks can import them by module path)."""
