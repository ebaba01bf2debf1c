"""LoRA adapters on megatron-core's column- and row-parallel linears, the frozen base, and the adapters-off reference.

``model.lora`` (:class:`LoraConfig`) puts a low-rank update beside chosen linears of every
transformer layer: the layer computes ``W x + (alpha / r) B A dropout(x)`` with ``A`` [r, in] and
``B`` [out, r] (B = 0 at the start, so the policy starts as the base exactly). The base's
parameters are frozen (``requires_grad`` False): megatron-core's frozen linears skip their weight
gradients, its DDP gives them no gradient buffer and its optimizer no state.

Layout under tensor parallelism (what SGLang's LoRA layers slice from a full adapter too):

* column-parallel base (``linear_qkv``, ``linear_fc1``; weight [out/TP, in]): A replicated, B split
  like the base's rows. Without sequence parallelism the low-rank activation ``A x`` is computed on
  every rank and its gradient all-reduced over TP (B's shard sees only its rows); with it, each
  rank projects its own tokens and the [s, b, r] activation is all-gathered (its gradient
  reduce-scattered), so A's gradient is a partial sum over tokens, reduced over TP by megatron's
  ``finalize_model_grads`` (A is marked ``sequence_parallel``, as the norms are).
* row-parallel base (``linear_proj``, ``linear_fc2``; weight [out, in/TP]): A split like the base's
  columns, B replicated. The partial ``A x`` is all-reduced (reduce-scattered over the sequence
  with SP, where B is then marked ``sequence_parallel``).

Context and data parallelism need nothing of their own (tokens and gradients as for any weight);
the experts of mixture-of-experts layers are never adapted (only dense MLPs' fc1/fc2 and the
attention). Transformer Engine fuses the pre-norm into ``linear_qkv`` / ``linear_fc1``: the adapter
then normalises the input itself with the fused norm's (frozen) weight, so it sees what the base
GEMM sees. Adapters are forward hooks of the base linears and modules of their own beside them
(``<target>_lora.lora_a`` / ``.lora_b``), so every base parameter keeps its name and checkpoint key.

Full recompute with a frozen base: megatron's checkpointed layers get a backward only when their
input requires grad, which the output of a frozen embedding does not, and the adapters inside would
get no gradient at all (Megatron-Bridge's PEFT recompute fix): the decoder's input is made to
require grad (:func:`apply_lora`).

The reference policy of a LoRA run is the same model with the adapters off
(:class:`AdaptersOffReference`): no second copy of the weights, and with B = 0 the conditional KL
at step 0 is exactly 0.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Iterator, List, Optional

import torch

from megatron_zcpo.utils.runtime import unwrap

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_PARALLEL_TARGETS = ("linear_qkv", "linear_fc1")
PUSH_MODES = ("merged", "adapter")
INITS = ("kaiming", "gaussian")
ADAPTER_SUFFIX = "_lora"  # the adapter of linear_qkv is the module linear_qkv_lora beside it
_ADAPTER_PARAMETER = re.compile(r"(linear_qkv|linear_proj|linear_fc1|linear_fc2)_lora\.lora_[ab]$")


@dataclass
class LoraConfig:
    """``model.lora``: low-rank adapters on the policy, the base frozen (module docstring).

    ``rank`` r and ``alpha`` (the update is scaled by alpha / r, as PEFT's ``lora_alpha``);
    ``targets``: megatron-core linears of every layer (:data:`LORA_TARGETS`; ``linear_fc1`` /
    ``linear_fc2`` only in dense MLPs: routed experts are never adapted); ``dropout`` on the
    adapter's input during the update; ``init`` of A: ``kaiming`` (PEFT's default, uniform with
    bound 1/sqrt(in)) or ``gaussian`` (N(0, 1/r²), PEFT's "gaussian"), B = 0 either way;
    ``push``: how rollouts get the policy, ``merged`` (W + (alpha/r) B A in fp32, cast to the
    served dtype, through the run's weight transport) or ``adapter`` (the adapter alone into SGLang's
    LoRA serving, a new adapter name per version).
    """

    rank: int = 16
    alpha: float = 32.0
    targets: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    dropout: float = 0.0
    init: str = "kaiming"
    push: str = "merged"

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor of B A."""
        return self.alpha / self.rank

    def validate(self, prefix: str = "model.lora") -> None:
        """Raise ``ValueError`` naming the offending key."""
        if self.rank < 1:
            raise ValueError(f"{prefix}.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"{prefix}.alpha must be > 0, got {self.alpha}")
        if not self.targets:
            raise ValueError(f"{prefix}.targets is empty: choose from {list(LORA_TARGETS)}")
        unknown = [target for target in self.targets if target not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"{prefix}.targets {unknown}: choose from {list(LORA_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"{prefix}.targets {self.targets} names a linear twice")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{prefix}.dropout must be in [0, 1), got {self.dropout}")
        if self.init not in INITS:
            raise ValueError(f"{prefix}.init={self.init!r}: choose from {INITS} (B starts at 0 either way)")
        if self.push not in PUSH_MODES:
            raise ValueError(f"{prefix}.push={self.push!r}: choose from {PUSH_MODES}")


def is_adapter_name(name: str) -> bool:
    """Whether a (local or global) parameter name is an adapter's ``<target>_lora.lora_a`` / ``.lora_b``."""
    return bool(_ADAPTER_PARAMETER.search(name))


def adapted_weight_name(adapter_name: str) -> str:
    """The base weight an adapter parameter belongs to: ``...linear_qkv_lora.lora_b`` -> ``...linear_qkv.weight``."""
    match = _ADAPTER_PARAMETER.search(adapter_name)
    if match is None:
        raise ValueError(f"{adapter_name!r} is not an adapter parameter")
    return adapter_name[: match.start()] + f"{match.group(1)}.weight"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm of the last dimension in fp32, cast back to ``x``'s dtype (Transformer Engine's fused norm)."""
    x32 = x.float()
    scale = weight.float() + (1.0 if zero_centered else 0.0)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one column- or row-parallel linear ``base`` (module docstring).

    ``lora_a`` [r, in] (row-parallel: [r, in/TP]) and ``lora_b`` [out/TP, r] (row-parallel:
    [out, r]), in the base's dtype and device; :meth:`forward` maps the base linear's input
    [s(/TP), b, in(/TP)] to the update of its output, shaped as the base's output. ``enabled``
    False makes the base linear compute the base alone (:func:`adapters_disabled`).
    """

    def __init__(self, base, target: str, layer: int, lora: LoraConfig, config, seed: int):
        super().__init__()
        self.target, self.layer = target, layer
        self.column = target in COLUMN_PARALLEL_TARGETS
        self.gated = target == "linear_fc1" and bool(config.gated_linear_unit)  # B stacks [gate; up] like fc1
        self.scaling = lora.scaling
        self.sequence_parallel = bool(config.sequence_parallel)
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else None
        self.enabled = True
        # Transformer Engine's LayerNormColumnParallelLinear takes the pre-norm input (its norm is fused).
        self.fused_norm = getattr(base, "layer_norm_weight", None) is not None
        if self.fused_norm and config.normalization != "RMSNorm":
            raise ValueError(f"model.lora: {target} fuses a {config.normalization}, only RMSNorm is supported")
        object.__setattr__(self, "base", base)  # not a submodule: its parameters stay the base's
        weight = base.weight
        out_local, in_local = weight.shape
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        in_global = in_local if self.column else in_local * tp
        a = self._initial_a(lora, in_global, seed)
        if not self.column:
            a = a.chunk(tp, dim=1)[tp_rank]
        self.lora_a = torch.nn.Parameter(a.to(weight.device, weight.dtype))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, lora.rank, device=weight.device, dtype=weight.dtype))
        # Which of the two is split over TP like the base, which is replicated (reduced over TP under SP).
        split, replicated = (self.lora_b, self.lora_a) if self.column else (self.lora_a, self.lora_b)
        set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        set_tensor_model_parallel_attributes(replicated, False, -1, 1)
        replicated.sequence_parallel = self.sequence_parallel

    def _initial_a(self, lora: LoraConfig, in_features: int, seed: int) -> torch.Tensor:
        """The global A [r, in] of this (layer, target), the same at every layout: drawn on the CPU from a
        generator seeded by (seed, layer, target)."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + self.layer * 16 + LORA_TARGETS.index(self.target))
        if lora.init == "gaussian":
            return torch.randn(lora.rank, in_features, generator=generator) / lora.rank
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) of a [r, in] weight
        return (torch.rand(lora.rank, in_features, generator=generator) * 2 - 1) * bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update (alpha/r) B A dropout(x) of the base's output for its input ``x``."""
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel import mappings

        if self.fused_norm:
            base = self.base
            x = _rms_norm(x, base.layer_norm_weight, base.eps, getattr(base, "zero_centered_gamma", False))
        if self.dropout is not None:
            if self.column:  # the input is the same on every TP rank: so is its mask (the default generator)
                x = self.dropout(x)
            else:  # each TP rank holds other input features: masks of its own
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    x = self.dropout(x)
        low = torch.nn.functional.linear(x, self.lora_a)
        if self.column:
            if self.sequence_parallel:  # [s/TP, b, r] -> [s, b, r]; backward: reduce-scatter of B's partial sums
                low = mappings.gather_from_sequence_parallel_region(low)
            else:  # backward: all-reduce of B's partial sums
                low = mappings.copy_to_tensor_model_parallel_region(low)
        elif self.sequence_parallel:  # partial sums over input features -> this rank's tokens
            low = mappings.reduce_scatter_to_sequence_parallel_region(low)
        else:
            low = mappings.reduce_from_tensor_model_parallel_region(low)
        return torch.nn.functional.linear(low, self.lora_b) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + (alpha/r) B A, computed out of place in fp32 and cast to W's dtype
        (column-parallel: [out/TP, in]; row-parallel: [out, in/TP], as the base's weight)."""
        with torch.no_grad():
            delta = self.lora_b.float() @ self.lora_a.float()
            return (self.base.weight.float() + self.scaling * delta).to(self.base.weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """megatron-core's sharded state of the two matrices: the split one along its TP axis (fc1's B as
        SwiGLU's [gate; up] halves, like the base's weight), the replicated one once."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"lora_b": 0} if self.column else {"lora_a": 1}
        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axis,
            sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        )
        if self.gated:
            key = f"{prefix}lora_b"
            state[key] = apply_swiglu_sharded_factory(
                state[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
            )
        return state


def _base_linears(layer) -> Iterator[tuple]:
    """(target, parent module, base linear) of one TransformerLayer: the attention's two linears and,
    in a dense layer, the MLP's (a mixture-of-experts layer's experts are never adapted)."""
    from megatron.core.transformer.mlp import MLP

    attention = layer.self_attention
    for target in ("linear_qkv", "linear_proj"):
        yield target, attention, getattr(attention, target)
    if isinstance(layer.mlp, MLP):
        for target in ("linear_fc1", "linear_fc2"):
            yield target, layer.mlp, getattr(layer.mlp, target)


def _add_adapter_output(adapter: LoraAdapter) -> Callable:
    """The forward hook of ``adapter``'s base linear: (output, bias) -> (output + update, bias)."""

    def hook(module, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(args[0]), bias

    return hook


def _input_requires_grad(module, args, kwargs):
    """Forward pre-hook of the decoder: its hidden-state input requires grad whenever a graph is built,
    so megatron's recomputed layers get a backward with a frozen embedding (module docstring)."""
    hidden = kwargs.get("hidden_states")
    if torch.is_grad_enabled() and torch.is_tensor(hidden) and not hidden.requires_grad:
        kwargs["hidden_states"] = hidden.detach().requires_grad_(True)
    return args, kwargs


def apply_lora(model, lora: LoraConfig, seed: int) -> List[LoraAdapter]:
    """Freeze ``model``'s stage (a GPTModel, wrappers allowed) and add ``lora``'s adapters to it.

    Call it after the base weights are loaded and before the DDP wrapper and the optimizer (which
    then see only the adapters). A (layer, target) gets the same initial A at every layout
    (``seed``: ``train.seed``). Returns this stage's adapters; ``model.zcpo_lora`` holds ``lora``.
    """
    lora.validate()
    gpt = unwrap(model)
    config = gpt.config
    for param in gpt.parameters():
        param.requires_grad_(False)
    adapters = []
    for layer in gpt.decoder.layers:
        for target, parent, base in _base_linears(layer):
            if target not in lora.targets:
                continue
            adapter = LoraAdapter(base, target, layer.layer_number - 1, lora, config, seed)
            parent.add_module(target + ADAPTER_SUFFIX, adapter)
            base.register_forward_hook(_add_adapter_output(adapter))
            adapters.append(adapter)
    if config.recompute_granularity is not None:
        gpt.decoder.register_forward_pre_hook(_input_requires_grad, with_kwargs=True)
    gpt.zcpo_lora = lora
    return adapters


def lora_of(model) -> Optional[LoraConfig]:
    """The :class:`LoraConfig` ``model`` (wrappers allowed) was adapted with, or None."""
    return getattr(unwrap(model), "zcpo_lora", None)


def lora_adapters(model) -> List[LoraAdapter]:
    """This stage's adapters (wrappers allowed), in module order."""
    return [module for module in unwrap(model).modules() if isinstance(module, LoraAdapter)]


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """Within the block, ``model``'s linears compute the base alone (a forward started inside; a
    recompute of the policy's forward during a later backward runs with the adapters on again)."""
    adapters = lora_adapters(model)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


class AdaptersOffReference(torch.nn.Module):
    """The frozen reference of a LoRA policy: the policy's own stage, run with its adapters off.

    Holds no weights (the policy is not a submodule). ``set_input_tensor`` keeps the previous
    stage's reference activation until :meth:`forward`, which hands it to the stage and runs it
    (under ``no_grad``, as every reference pass does) with the adapters off and inside
    ``around_forward()`` when set (a mixture-of-experts policy's routing-replay taps are bypassed
    there: the reference routes freely). ``module`` leads ``unwrap`` to the policy's GPTModel (its
    output layer is the reference's too).
    """

    def __init__(self, policy, around_forward: Optional[Callable[[], ContextManager]] = None):
        super().__init__()
        object.__setattr__(self, "_policy", policy)
        self.around_forward = around_forward
        self._input_tensor: Optional[torch.Tensor] = None

    @property
    def module(self):
        return self._policy

    def set_input_tensor(self, input_tensor) -> None:
        self._input_tensor = input_tensor

    def forward(self, *args, **kwargs):
        gpt = unwrap(self._policy)
        if not gpt.pre_process:
            gpt.set_input_tensor(self._input_tensor)
        around = self.around_forward() if self.around_forward is not None else contextlib.nullcontext()
        with adapters_disabled(gpt), around:
            return self._policy(*args, **kwargs)


def adapter_parameter_count(lora: LoraConfig, model_config) -> Dict[str, int]:
    """Adapter parameters of one layer by target, for ``model_config`` (a ModelConfig; dense MLPs):
    r x (in + out) per adapted linear."""
    h, d = model_config.hidden_size, model_config.kv_channels
    q, kv = model_config.num_attention_heads * d, 2 * model_config.num_key_value_heads * d
    f = model_config.intermediate_size
    shapes = {"linear_qkv": (h, q + kv), "linear_proj": (q, h), "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}
    return {target: lora.rank * sum(shapes[target]) for target in lora.targets}
