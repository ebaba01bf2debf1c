"""KL failure-mode diagnostics F1-F7 and run reports."""
