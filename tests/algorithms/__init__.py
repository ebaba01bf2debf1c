"""Tests of megatron_zcpo/algorithms/."""
