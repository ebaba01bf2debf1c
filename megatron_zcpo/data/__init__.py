"""Datasets: prompt files (JSONL/Parquet), procedural tasks, resumable iteration."""
