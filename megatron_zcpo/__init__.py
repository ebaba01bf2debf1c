"""megatron_zcpo: RL post-training of LLMs on megatron-core with ZCPO.

The public names of ../shared/API.md are importable from here. They load lazily, so that
``import megatron_zcpo`` stays light and never imports CUDA-only packages (Transformer Engine,
apex, SGLang); megatron-core itself is imported only by the names that need it.
"""

import importlib
import warnings as _warnings

# megatron-core announces its CPU fallbacks at import; on CPU machines they are expected.
_warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)( and Apex)? (is|are) not installed.*")
_warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "setup_megatron": "megatron_zcpo.megatron.initialize",
    "ModelConfig": "megatron_zcpo.megatron.model",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_zcpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
