"""CPU platform layer: lets unmodified megatron-core run over gloo on a machine without CUDA.

megatron-core assumes a CUDA device in a handful of places: the RNG tracker reads
and writes CUDA generator state, `torch.cuda.current_device()` is used as a device, some schedules,
grad-clipping and optimizer code allocate with a hard-coded ``device="cuda"``, p2p calls
``torch.cuda.synchronize``, tied embeddings under PP call ``.cuda()``, and the optimizers compare
``param.type()`` with ``'torch.cuda.FloatTensor'``. Everything that handles those assumptions lives
in this one module, and :func:`activate` does nothing when CUDA is available, so on a GPU machine
megatron-core runs exactly as shipped. Whether CUDA is there is decided in
``megatron_zcpo/utils/devices.py``, which every layer asks.

How it works, in one place each:
- every loaded ``megatron.core`` module sees a proxy in place of its global ``torch`` whose
  ``cuda`` namespace is CPU-backed and whose tensor factories map ``device="cuda"`` to the CPU;
- the model-parallel RNG tracker forks the CPU generator instead of a CUDA one;
- ``Tensor.cuda()`` is the identity (it could only raise on such a machine);
- the optimizer constructors that check ``param.type()`` see CUDA type names while they run;
- the MoE all-to-all dispatcher's split sizes become the lists ``all_to_all_single`` takes (on a
  GPU megatron gets them by copying device tensors to host numpy arrays, which a CPU tensor skips);
- the distributed optimizer's fully-reshardable checkpoints load into torch's Adam (the fallback
  without TE/apex keeps a per-parameter ``step`` that megatron's loader does not expect, and
  that a fresh optimizer lacks).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from typing import Any, Callable

import torch

from megatron_zcpo.utils.devices import has_cuda

_ACTIVE = False


# megatron-core modules to import before patching, so the proxy reaches them; anything else
# under megatron.core that is already imported gets it too.
_MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.module",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.validation",
    "megatron.core.rerun_state_machine",
)

_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
    "eye",
)


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, an int) to CPU."""
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapper


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return _NullEvent()


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_cuda_namespace() -> types.SimpleNamespace:
    """A ``torch.cuda`` look-alike backed by the CPU; unknown names fall through to torch.cuda."""
    null = lambda *args, **kwargs: None  # noqa: E731
    shim = {
        "current_device": lambda: torch.device("cpu"),
        "device_count": lambda: 0,
        "synchronize": null,
        "empty_cache": null,
        "set_device": null,
        "get_rng_state": lambda device=None: torch.get_rng_state(),
        "set_rng_state": lambda state, device=None: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "Stream": _NullStream,
        "Event": _NullEvent,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "current_stream": lambda device=None: _NullStream(),
        "default_stream": lambda device=None: _NullStream(),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "nvtx": types.SimpleNamespace(range_push=null, range_pop=null, range=lambda *a, **k: contextlib.nullcontext()),
    }

    class _Namespace(types.SimpleNamespace):
        def __getattr__(self, name):
            return getattr(torch.cuda, name)

    return _Namespace(**shim)


class _TorchOnCpu(types.ModuleType):
    """Proxy for the ``torch`` module as seen by megatron-core modules on a CUDA-less machine."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _cpu_cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups are plain attribute hits
        return value


class _CpuRNGStatesTracker:
    """Model-parallel RNG tracker over the CPU generator (megatron's tracks CUDA generators)."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


@contextlib.contextmanager
def _cuda_type_names():
    """While active, ``Tensor.type()`` with no argument reports CUDA names (``torch.cuda.FloatTensor``)."""
    original = torch.Tensor.type

    def cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def _patch_type_checks() -> None:
    """Wrap the megatron functions that assert ``param.type() == 'torch.cuda.*'``."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    targets = [
        (distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups", staticmethod),
        (optimizer.Float16OptimizerWithFloat16Params, "__init__", None),
    ]
    for owner, name, kind in targets:
        wrapped = _with_cuda_type_names(getattr(owner, name))
        setattr(owner, name, kind(wrapped) if kind else wrapped)
    # Imported by name elsewhere (optimizer.py): replace every reference to the same function.
    original = clip_grads.clip_grad_by_total_norm_fp32
    wrapped = _with_cuda_type_names(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "clip_grad_by_total_norm_fp32", None) is original:
            module.clip_grad_by_total_norm_fp32 = wrapped


def _patch_distributed_optimizer_loading() -> None:
    """Let a fully-reshardable distributed-optimizer checkpoint load into a fresh torch Adam.

    Without TE/apex megatron falls back to ``torch.optim.Adam``, whose per-parameter state has a
    ``step`` entry. The fully-reshardable loader restores ``step`` separately and hands
    ``_set_main_param_and_optimizer_states`` only the param and moment tensors, which then looks
    up every state key and fails on ``step``. Copy the tensors that were handed over.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_present_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            destinations[key].copy_(value)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_present_states

    # Loading starts from a fresh optimizer whose torch Adam has no state yet, but the
    # distributed optimizer's state_dict() reads every parameter's ``step``: initialise the state
    # first, as the plain optimizer's sharded_state_dict does when loading.
    original_sharded = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, *args, **kwargs):
        if is_loading and len(self.optimizer.state) == 0:
            self.init_state_fn(self.optimizer, self.config)
        return original_sharded(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict

    # The loader sets every parameter's ``step`` to ONE shared tensor; torch's Adam increments
    # ``step`` in place per parameter, so a shared tensor would advance once per parameter per
    # step and skew the bias correction after a resume. Give each parameter its own copy.
    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict


def _patch_adam_state_init() -> None:
    """Give torch Adam's freshly initialised state a ``step``, as a stepped optimizer has.

    Loading a checkpoint builds the optimizer's sharded state dict from a fresh optimizer
    (``init_state_fn`` creates zero moments); the distributed optimizer then reads ``step`` from
    every parameter's state, which torch's Adam only creates on its first step. The value is a
    placeholder: loading overwrites it with the checkpoint's.
    """
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    original = MegatronOptimizer.__init__

    def init(self, optimizer, config, init_state_fn=lambda x: None):
        def init_with_step(opt, config=None):
            init_state_fn(opt, config)
            if isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam
                for state in opt.state.values():
                    state.setdefault("step", torch.tensor(0.0))

        original(self, optimizer, config, init_with_step)

    MegatronOptimizer.__init__ = init


def _patch_moe_split_sizes() -> None:
    """megatron's all-to-all token dispatcher turns its split-size tensors into host numpy arrays
    with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which returns CPU tensors unchanged;
    ``all_to_all_single`` rejects tensors as split sizes. Convert them on the CPU as well."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        tensor = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def activate() -> bool:
    """Install the CPU platform patches if (and only if) CUDA is unavailable.

    Idempotent. Returns True when the patches are (now) active, False on a CUDA machine, where
    nothing is touched.
    """
    global _ACTIVE
    if _ACTIVE:
        return True
    if has_cuda():
        return False
    for name in _MEGATRON_MODULES:
        with contextlib.suppress(ImportError):  # optional parts of megatron-core absent in this version
            importlib.import_module(name)
    proxy = _TorchOnCpu()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy

    from megatron.core.tensor_parallel import random as mp_random

    mp_random.CudaRNGStatesTracker = _CpuRNGStatesTracker
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    _patch_type_checks()
    _patch_distributed_optimizer_loading()
    _patch_adam_state_init()
    _patch_moe_split_sizes()
    _ACTIVE = True
    return True
