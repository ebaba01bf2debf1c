"""Tests of megatron_zcpo/diagnostics/."""
