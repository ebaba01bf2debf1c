"""Tests of megatron_zcpo/rollout/."""
