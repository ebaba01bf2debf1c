"""Tests of megatron_zcpo/megatron/."""
