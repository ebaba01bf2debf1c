"""Mixture-of-experts terms of the memory planner and the step model: experts per GPU, their activations, all-to-all bytes.

Pure arithmetic on a :class:`~megatron_zcpo.megatron.model.ModelConfig` (no GPU), used by
:mod:`megatron_zcpo.planning.memory_model` and :mod:`megatron_zcpo.planning.step_time`. Layers are
counted by their share: a pipeline stage holding ``L`` of the model's layers holds that share of
its MoE layers (Qwen3-MoE: all of them). Routing is not balanced: megatron-core's drop-less
dispatch (no capacity factor) gives the busiest expert-parallel rank ``imbalance`` times the mean
``tokens x top-k / EP`` routed tokens, and memory and time are those of that rank.
:data:`DEFAULT_EXPERT_IMBALANCE` = 1.3 is the low end of the inter-rank imbalance measured on MoE
models of 106B to 671B parameters without a balancer, 1.30 to 4.01 (UltraEP, arXiv:2606.04101,
abstract); ``zcpo plan --expert-imbalance`` (``Workload.expert_imbalance``) sets another.

* Parameters: each MoE layer has the router (experts x hidden, on every rank), the experts
  (``num_experts / EP`` of them on a rank, each ``3 x hidden x moe_intermediate / ETP``) and
  Qwen2-MoE's shared expert (split over TP like a dense MLP) and its gate.
* Activations of an MoE layer's MLP, per token on a rank (16-bit, SwiGLU, sequence parallel
  under TP as megatron-core requires): each of its ``top-k`` expert copies keeps the permuted input
  and the expert output (2 x hidden each) and SwiGLU's fc1 output and product (3 x
  moe_intermediate) in 2-byte values, plus the fp32 router logits: ``k (4 h + 6 F) + 4 E``.
* All-to-all: every MoE layer sends each token's ``top-k`` copies of the hidden state to the
  experts' ranks and brings the outputs back: ``2 x k x h x 2`` bytes per token, of which the
  share ``(EP - 1) / EP`` leaves the rank; the backward moves the gradients the same way.
"""

from __future__ import annotations

from megatron_zcpo.megatron.model import ModelConfig

BYTES_BF16 = 2
BYTES_FP32 = 4
DEFAULT_EXPERT_IMBALANCE = 1.3  # busiest EP rank's routed tokens / the mean (module docstring)


def moe_layer_share(model: ModelConfig) -> float:
    """The fraction of the model's layers that route to experts (0 for a dense model)."""
    return sum(model.moe_layer_pattern) / model.num_layers


def non_expert_mlp_parameters(model: ModelConfig, tensor_parallel: int) -> float:
    """MLP parameters per layer (on average over the layers) one TP rank holds besides the routed
    experts: dense layers' MLP split over TP; MoE layers' router (replicated) and shared expert
    (split over TP) with its gate (replicated)."""
    share = moe_layer_share(model)
    h = model.hidden_size
    dense = 3 * h * model.intermediate_size / tensor_parallel
    routed: float = model.num_experts * h
    if model.shared_expert_intermediate_size:
        routed += 3 * h * model.shared_expert_intermediate_size / tensor_parallel + h
    return (1 - share) * dense + share * routed


def expert_parameters_per_gpu(
    model: ModelConfig, layers: float, expert_parallel: int, expert_tensor_parallel: int
) -> float:
    """Routed-expert parameters one GPU holds for ``layers`` of the model's layers."""
    if not model.is_moe:
        return 0.0
    per_layer = model.num_experts / expert_parallel * model.expert_parameters() / expert_tensor_parallel
    return layers * moe_layer_share(model) * per_layer


def moe_mlp_activation_bytes_per_token(model: ModelConfig, imbalance: float = 1.0) -> float:
    """Bytes an MoE layer's MLP keeps per token of the rank for its backward (module docstring): the
    routed copies scale with ``imbalance`` (the busiest rank's tokens / the mean), the router logits not."""
    k, h = model.num_experts_per_tok, model.hidden_size
    return imbalance * k * BYTES_BF16 * (2 * h + 3 * model.moe_intermediate_size) + BYTES_FP32 * model.num_experts


def all_to_all_bytes_per_token_layer(model: ModelConfig, expert_parallel: int, imbalance: float = 1.0) -> float:
    """Bytes the busiest rank moves per token and MoE layer in one pass (dispatch and combine): it
    receives ``imbalance`` times the mean share of the routed copies."""
    if not model.is_moe or expert_parallel == 1:
        return 0.0
    per_copy = 2 * model.num_experts_per_tok * model.hidden_size * BYTES_BF16
    return imbalance * per_copy * (expert_parallel - 1) / expert_parallel
