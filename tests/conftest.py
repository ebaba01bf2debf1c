"""Shared pytest settings: quiet megatron's CPU fallback warnings, deterministic threads."""

import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (is|are) not installed.*")
