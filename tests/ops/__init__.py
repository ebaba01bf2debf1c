"""Tests of megatron_zcpo/ops/."""
