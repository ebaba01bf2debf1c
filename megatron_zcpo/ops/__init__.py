"""Parallel ops: vocab-parallel token statistics over tensor-parallel process groups (no model)."""
