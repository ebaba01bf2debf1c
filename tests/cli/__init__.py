"""Tests of the command line (megatron_zcpo/cli/), the recipe it runs (megatron_zcpo/recipe/) and examples/."""
