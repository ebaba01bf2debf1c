"""megatron-core's local (CPU) GPT block spec: packed/context-parallel core attention and a sequence-parallel RMSNorm."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built by megatron's ``build_module`` that also runs under sequence parallelism.

    megatron-core's ``WrappedTorchNorm`` refuses ``config.sequence_parallel``; the norm itself is
    per token, so with the sequence dimension scattered over the TP ranks it needs nothing but
    the gradient of its weight summed over TP (each rank saw only its tokens). As Transformer
    Engine's norms do, the weight is marked ``sequence_parallel``, and megatron's
    ``finalize_model_grads`` all-reduces such gradients over the TP group. Input [..., hidden].
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"SequenceParallelRMSNorm is a plain RMSNorm; got normalization={config.normalization!r}, "
                f"zero_centered_gamma={config.layernorm_zero_centered_gamma}"
            )
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def local_layer_spec(
    qk_layernorm: bool = False, num_experts: Optional[int] = None, multi_latent_attention: bool = False
):
    """megatron-core's local GPT layer spec (RMSNorm; per-head q/k RMSNorm when ``qk_layernorm``) with
    :class:`~megatron_zcpo.megatron.attention.PackedCausalAttention` as core attention and
    :class:`SequenceParallelRMSNorm` as its norms (the q/k norms too: megatron sums their
    gradients over TP either way, see finalize_model_grads). With ``num_experts`` the MLP is
    megatron's MoE layer with SequentialMLP experts (one local MLP per expert: no grouped GEMM on CPUs).
    With ``multi_latent_attention`` the attention is megatron's ``MLASelfAttention`` and
    ``qk_layernorm`` its latent norms (``q_layernorm`` over the query latent, ``kv_layernorm`` over
    the key/value latent); under sequence parallelism each rank normalises its own tokens' latents.
    Its down-projections are megatron's duplicated local ``Linear`` (each TP rank the whole weight,
    its gradient summed over TP under sequence parallelism), as Transformer Engine's spec has them:
    the local spec's column-parallel ones lose gradient in megatron-core 0.16.1 (the rope key's
    gradient from the other ranks' heads is never summed: ``gather_from_tensor_model_parallel_region``
    splits it back unreduced), which the TP2 training test showed."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_zcpo.megatron.attention import PackedCausalAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
    )
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = PackedCausalAttention
    if multi_latent_attention:
        from megatron.core.post_training.modelopt.layers import Linear

        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
    if qk_layernorm and multi_latent_attention:
        attention.q_layernorm = attention.kv_layernorm = SequenceParallelRMSNorm
    elif qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    spec.submodules.sharded_state_dict_keys_map = te_checkpoint_keys(bool(num_experts), multi_latent_attention)
    return spec


def te_checkpoint_keys(moe: bool, multi_latent_attention: bool) -> Dict[str, str]:
    """The layer's ``sharded_state_dict_keys_map``: each norm that Transformer Engine's layer spec
    fuses into the linear after it (megatron-core 0.16.1 ``get_gpt_layer_with_transformer_engine_spec``)
    is checkpointed under that linear's ``layer_norm_`` key, so a checkpoint written on one spec loads
    on the other (converted checkpoints are written on this one; GPU training saves on TE's).
    Fused there: the input norm into ``linear_qkv`` (MLA keeps a separate input norm), MLA's latent
    norms into ``linear_q_up_proj`` / ``linear_kv_up_proj``, and a dense layer's pre-MLP norm into
    ``linear_fc1``; a mixture-of-experts layer keeps its own ``pre_mlp_layernorm`` (megatron's local
    spec maps it to ``linear_fc1`` too, which TE's MoE layer does not have)."""
    if multi_latent_attention:
        keys = {
            "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
            "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
        }
    else:
        keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe:
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return keys


def moe_layer_flags(config) -> List[bool]:
    """Per global layer, whether megatron-core builds a routed-expert MLP there (``moe_layer_freq``:
    an int N means every N-th layer from the first, a list gives each layer's 0/1)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    frequency = config.moe_layer_freq
    if isinstance(frequency, int):
        return [i % frequency == 0 for i in range(config.num_layers)]
    return [bool(flag) for flag in frequency]


def local_block_spec(config):
    """The transformer-block spec of this rank's pipeline stage: :func:`local_layer_spec` layers
    (dense or mixture-of-experts, as :func:`moe_layer_flags` says for each) and a
    :class:`SequenceParallelRMSNorm` final norm (megatron would pick ``WrappedTorchNorm``)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    flags = moe_layer_flags(config)[offset : offset + get_num_layers_to_build(config)]
    mla = bool(getattr(config, "multi_latent_attention", False))
    specs = {
        moe: local_layer_spec(config.qk_layernorm, config.num_moe_experts if moe else None, mla) for moe in set(flags)
    }
    return TransformerBlockSubmodules(layer_specs=[specs[moe] for moe in flags], layer_norm=SequenceParallelRMSNorm)
