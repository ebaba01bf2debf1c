"""Tests of megatron_zcpo/convert/."""
