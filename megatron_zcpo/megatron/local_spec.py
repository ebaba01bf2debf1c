"""megatron-core's local (CPU) GPT block spec: packed/context-parallel core attention and a sequence-parallel RMSNorm."""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built by megatron's ``build_module`` that also runs under sequence parallelism.

    megatron-core's ``WrappedTorchNorm`` refuses ``config.sequence_parallel``; the norm itself is
    per token, so with the sequence dimension scattered over the TP ranks it needs nothing but
    the gradient of its weight summed over TP (each rank saw only its tokens). As Transformer
    Engine's norms do, the weight is marked ``sequence_parallel``, and megatron's
    ``finalize_model_grads`` all-reduces such gradients over the TP group. Input [..., hidden].
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"SequenceParallelRMSNorm is a plain RMSNorm; got normalization={config.normalization!r}, "
                             f"zero_centered_gamma={config.layernorm_zero_centered_gamma}")
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))


def local_layer_spec(qk_layernorm: bool = False):
    """megatron-core's local GPT layer spec (RMSNorm; per-head q/k RMSNorm when ``qk_layernorm``) with
    :class:`~megatron_zcpo.megatron.attention.PackedCausalAttention` as core attention and
    :class:`SequenceParallelRMSNorm` as its norms (the q/k norms too: megatron sums their
    gradients over TP either way, see finalize_model_grads)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_zcpo.megatron.attention import PackedCausalAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = PackedCausalAttention
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return spec


def local_block_spec(config):
    """The transformer-block spec of this rank's pipeline stage: :func:`local_layer_spec` layers
    and a :class:`SequenceParallelRMSNorm` final norm (megatron would pick ``WrappedTorchNorm``)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[local_layer_spec(config.qk_layernorm)] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelRMSNorm)
