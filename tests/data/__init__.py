"""Tests of megatron_zcpo/data/."""
