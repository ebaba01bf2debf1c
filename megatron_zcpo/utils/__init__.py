"""Small shared utilities (config loading) used by every layer."""
