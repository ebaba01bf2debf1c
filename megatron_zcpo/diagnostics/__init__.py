"""KL failure-mode diagnostics F1-F7 and run reports."""

from megatron_zcpo.diagnostics.config import FAMILIES, DiagnosticsConfig
from megatron_zcpo.diagnostics.runner import KLDiagnostics, build_diagnostics

__all__ = ["FAMILIES", "DiagnosticsConfig", "KLDiagnostics", "build_diagnostics"]
