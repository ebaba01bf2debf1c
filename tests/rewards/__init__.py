"""Tests of megatron_zcpo/rewards/."""
