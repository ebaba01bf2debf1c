"""Model configuration (Hugging Face-style fields) and megatron-core GPTModel construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_zcpo.utils.devices import has_cuda

SUPPORTED_FAMILIES = ("qwen2", "qwen3", "llama")


@dataclass
class ModelConfig:
    """Architecture of a decoder-only LM in Hugging Face terms (Qwen2/Qwen2.5, Qwen3 dense and Llama).

    ``head_dim`` is megatron-core's ``kv_channels``: independent of hidden/heads (Qwen3-4B: hidden
    2560, 32 heads, head_dim 128). ``qk_layernorm`` is Qwen3's per-head RMSNorm of queries and keys
    (one ``[head_dim]`` weight each, shared by all heads, before RoPE).

    ``vocab_size`` is the true vocabulary; Megatron pads it to a multiple of
    ``make_vocab_size_divisible_by * tensor_parallel`` (see :func:`padded_vocab_size`).
    """

    family: str = "qwen2"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: Optional[bool] = None  # None: the family's default (Qwen2: True, Qwen3 and Llama: False)
    qk_layernorm: Optional[bool] = None  # None: the family's default (Qwen3: True, others: False)
    rope_scaling: Optional[dict] = None  # Llama-3.x {"rope_type": "llama3", "factor": ...}
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self):
        if self.qkv_bias is None:
            self.qkv_bias = self.family == "qwen2"
        if self.qk_layernorm is None:
            self.qk_layernorm = self.family == "qwen3"
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)

    def validate(self, prefix: str = "model") -> None:
        """Raise ``ValueError`` naming the offending key when the architecture is inconsistent."""
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(f"{prefix}.family={self.family!r}: supported families are {SUPPORTED_FAMILIES}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{prefix}.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type != "llama3":
                raise ValueError(f"{prefix}.rope_scaling: only rope_type 'llama3' is supported, got {rope_type!r}")
            expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
            for key, value in expected.items():
                if key in self.rope_scaling and float(self.rope_scaling[key]) != float(value):
                    raise ValueError(
                        f"{prefix}.rope_scaling.{key}={self.rope_scaling[key]}: megatron-core's llama3 "
                        f"rope scaling fixes it at {value}"
                    )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def num_parameters(self) -> int:
        """Parameter count of the unpadded model (embeddings counted once when tied)."""
        h, v, f = self.hidden_size, self.vocab_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.num_key_value_heads * self.head_dim
        attn = h * (q + kv) + q * h + ((q + kv) if self.qkv_bias else 0)
        mlp = 3 * h * f
        per_layer = attn + mlp + 2 * h + (2 * self.head_dim if self.qk_layernorm else 0)
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(
    model: ModelConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    **overrides: Any,
):
    """The megatron-core ``TransformerConfig`` for ``model`` at the given parallelism."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = has_cuda()
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(model.qkv_bias),
        qk_layernorm=bool(model.qk_layernorm),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not on_gpu,
        # The fused kernels below are CUDA-only; on a GPU, megatron picks them when TE/apex exist.
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=False,
        # Micro-batches of packed responses vary in length; PP then exchanges shapes first.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the default 'allgather' refuses variable lengths
    )
    if recompute:
        kwargs.update(recompute_granularity=recompute)
        if recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def have_transformer_engine() -> bool:
    """Whether Transformer Engine is importable (GPU clusters)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return has_cuda()


def layer_spec(config, use_te: Optional[bool] = None):
    """The TE layer spec when Transformer Engine is present (and ``use_te`` not False), else the
    local block spec of this pipeline stage: packed-sequence / context-parallel core attention and
    sequence-parallel RMSNorms (megatron_zcpo.megatron.local_spec).
    Both carry per-head q/k RMSNorms when ``config.qk_layernorm`` (Qwen3)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_zcpo.megatron.local_spec import local_block_spec

    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return local_block_spec(config)


def build_gpt_model(
    model: ModelConfig,
    config,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    use_te: Optional[bool] = None,
):
    """Build this rank's stage of a megatron-core ``GPTModel`` for ``model``.

    ``config`` is the ``TransformerConfig`` from :func:`transformer_config`. Pipeline stage flags
    default to this rank's position in the pipeline. Returns the module on the current device
    (CUDA when available, else CPU), with the padded vocabulary.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    rope = model.rope_scaling or {}
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, use_te),
        vocab_size=padded_vocab_size(
            model.vocab_size, config.tensor_model_parallel_size, model.make_vocab_size_divisible_by
        ),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        rope_scaling=bool(rope),
        rope_scaling_factor=float(rope.get("factor", 8.0)),
    )
    gpt.zcpo_model_config = model  # the true vocabulary and architecture, for weights and checkpoints
    if has_cuda() and not next(gpt.parameters()).is_meta:
        gpt = gpt.cuda()
    return gpt
