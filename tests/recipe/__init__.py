"""Tests of megatron_zcpo/recipe/ (the end-to-end runs are in tests/cli/)."""
