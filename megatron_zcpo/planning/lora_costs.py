"""LoRA in the planner: the adapters' parameters per GPU, the frozen base's cheaper backward, an adapter push's bytes.

Pure arithmetic on a :class:`~megatron_zcpo.megatron.model.ModelConfig` (no process group, no GPU),
for :mod:`megatron_zcpo.planning.memory_model` and :mod:`megatron_zcpo.planning.step_time`. The
adapters follow :mod:`megatron_zcpo.megatron.lora`: r x (in + out) parameters per adapted linear,
in every layer's attention and in the dense layers' MLPs (never in routed experts).
"""

from __future__ import annotations

from typing import Sequence

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.moe_costs import moe_layer_share

# The linears LoRA adapts (megatron_zcpo.megatron.lora.LORA_TARGETS) and their TP role: column-parallel
# ones split their adapter's B over TP (A replicated), row-parallel ones A (B replicated).
LORA_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_layer_parameters(model: ModelConfig, rank: int, targets: Sequence[str], tensor_parallel: int = 1) -> float:
    """Adapter parameters of one transformer layer held by one TP rank (the layers' average for a
    mixture-of-experts model, whose MoE layers adapt only the attention): r x (in + out) per linear,
    the split matrix divided by TP."""
    h, tp = model.hidden_size, tensor_parallel
    q = model.num_attention_heads * model.kv_channels
    kv = 2 * model.num_key_value_heads * model.kv_channels
    f = model.intermediate_size
    # (replicated, split) sizes of (A, B) per linear: column-parallel B split, row-parallel A split
    sizes = {
        "linear_qkv": (rank * h, (q + kv) * rank),
        "linear_proj": (h * rank, rank * q),
        "linear_fc1": (rank * h, 2 * f * rank),
        "linear_fc2": (h * rank, rank * f),
    }
    dense_share = 1.0 - moe_layer_share(model)
    total = 0.0
    for target in targets:
        replicated, split = sizes[target]
        total += (replicated + split / tp) * (dense_share if target in ("linear_fc1", "linear_fc2") else 1.0)
    return total


def lora_parameters(model: ModelConfig, rank: int, targets: Sequence[str]) -> float:
    """Adapter parameters of the whole model (TP = 1): what an adapter push sends, in bf16 twice as many bytes."""
    return model.num_layers * lora_layer_parameters(model, rank, targets)


# Forward-equivalents of the update's backward: a trained layer computes its input gradient and its
# weight gradient (2 forwards); a frozen base only the input gradient (1), the adapters' own GEMMs being
# r/hidden of a layer's.
BACKWARD_FORWARDS = 2
FROZEN_BACKWARD_FORWARDS = 1
