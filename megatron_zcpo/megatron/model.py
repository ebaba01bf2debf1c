"""Model configuration (Hugging Face-style fields) and megatron-core GPTModel construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_zcpo.utils.devices import has_cuda

SUPPORTED_FAMILIES = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe", "deepseek_v3")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3")


@dataclass
class MoETraining:
    """``train.moe``: the router's auxiliary losses during RL (megatron-core's coefficients).

    ``aux_loss_coeff``: the load-balancing loss (``--moe-aux-loss-coeff``; megatron-core averages
    each micro-batch's loss over the micro-batches). Default 0, as slime runs Qwen3-MoE RL
    (``--moe-aux-loss-coeff 0``, scripts/models in THUDM/slime): the pretrained router is balanced
    already, and a balancing gradient that ignores the reward moves the router between the
    rollout and the update, which is exactly the train/rollout routing mismatch RL must avoid.
    ``z_loss_coeff``: ST-MoE's router z-loss (None: off, as the peers run it).
    ``expert_bias_update_rate``: DeepSeek's auxiliary-loss-free balancing of a router with a
    correction bias (DeepSeek-V3's ``e_score_correction_bias``; megatron-core's
    ``moe_router_bias_update_rate``: after every optimizer step each expert's bias moves by this
    much towards the mean load). Default 0, the bias frozen: it was balanced over the pretraining
    data, an RL batch is a few hundred prompts of one task, and a bias that chases their load
    moves the routing between the rollout and the update (as the aux loss would) with no gain to
    the reward; the pushed weights carry the bias either way.
    """

    aux_loss_coeff: float = 0.0
    z_loss_coeff: Optional[float] = None
    expert_bias_update_rate: float = 0.0

    def validate(self, prefix: str = "train.moe") -> None:
        """Raise ``ValueError`` naming the key on a negative coefficient."""
        if self.aux_loss_coeff < 0:
            raise ValueError(f"{prefix}.aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        if self.z_loss_coeff is not None and self.z_loss_coeff < 0:
            raise ValueError(f"{prefix}.z_loss_coeff must be >= 0 (or null), got {self.z_loss_coeff}")
        if self.expert_bias_update_rate < 0:
            raise ValueError(f"{prefix}.expert_bias_update_rate must be >= 0, got {self.expert_bias_update_rate}")


@dataclass
class ModelConfig:
    """Architecture of a decoder-only LM in Hugging Face terms (Qwen2/Qwen2.5, Qwen3 dense, Llama,
    the mixture-of-experts Qwen2-MoE and Qwen3-MoE, and DeepSeek-V3 / Kimi-K2 / Moonlight).

    ``head_dim`` is megatron-core's ``kv_channels``: independent of hidden/heads (Qwen3-4B: hidden
    2560, 32 heads, head_dim 128). ``qk_layernorm`` is Qwen3's per-head RMSNorm of queries and keys
    (one ``[head_dim]`` weight each, shared by all heads, before RoPE).

    ``vocab_size`` is the true vocabulary; Megatron pads it to a multiple of
    ``make_vocab_size_divisible_by * tensor_parallel`` (see :func:`padded_vocab_size`).

    Mixture of experts (``num_experts`` > 0), as in Hugging Face's Qwen3-MoE / Qwen2-MoE configs:
    layer i has a routed-expert MLP unless it is in ``mlp_only_layers`` or (i + 1) is not a
    multiple of ``decoder_sparse_step`` (those keep a dense MLP of ``intermediate_size``); each
    expert is a SwiGLU MLP of ``moe_intermediate_size``; a softmax router picks
    ``num_experts_per_tok`` experts per token, their weights renormalised to sum to 1 when
    ``norm_topk_prob``; Qwen2-MoE adds a sigmoid-gated shared expert of
    ``shared_expert_intermediate_size``.

    DeepSeek-V3 (``deepseek_v3``, :mod:`megatron_zcpo.megatron.deepseek`): multi-latent attention
    (``kv_lora_rank`` > 0: keys and values from a ``kv_lora_rank`` latent, queries from a
    ``q_lora_rank`` one or, None, straight from the hidden state; per head ``qk_nope_head_dim`` +
    ``qk_rope_head_dim`` query/key and ``v_head_dim`` value channels; ``head_dim`` is then the
    query/key width), YaRN in ``rope_scaling``; DeepSeekMoE: layer i routes when i >=
    ``first_k_dense_replace`` and i % ``moe_layer_freq`` == 0, a sigmoid router
    (``router_score_function``) with the load-balancing correction bias (``router_expert_bias``,
    DeepSeek's ``noaux_tc``) choosing among ``router_group_topk`` of ``router_num_groups`` expert
    groups, the chosen weights renormalised and scaled by ``routed_scaling_factor``, and
    ``shared_expert_intermediate_size`` = n_shared_experts x moe_intermediate_size (no gate).
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
    qkv_bias: Optional[bool] = None  # None: the family's default (Qwen2(-MoE): True, Qwen3(-MoE), Llama: False)
    qk_layernorm: Optional[bool] = None  # None: the family's default (Qwen3(-MoE): True, others: False)
    rope_scaling: Optional[dict] = None  # Llama-3.x {"rope_type": "llama3", "factor": ...}
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = dataclasses.field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated / DeepSeek's plain shared experts; 0: none
    q_lora_rank: Optional[int] = None  # multi-latent attention (kv_lora_rank > 0); None: no query latent
    kv_lora_rank: int = 0  # 0: not multi-latent attention
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_k_dense_replace: int = 0  # DeepSeekMoE: the first layers keep a dense MLP
    moe_layer_freq: int = 1  # DeepSeekMoE: every moe_layer_freq-th layer (from 0) routes
    routed_scaling_factor: float = 1.0
    router_score_function: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    router_expert_bias: bool = False  # DeepSeek's noaux_tc e_score_correction_bias
    router_num_groups: int = 1  # DeepSeek's n_group: experts in groups, ...
    router_group_topk: int = 1  # ... of which topk_group per token are eligible

    def __post_init__(self):
        if self.qkv_bias is None:
            self.qkv_bias = self.family in ("qwen2", "qwen2_moe")
        if self.qk_layernorm is None:
            self.qk_layernorm = self.family in ("qwen3", "qwen3_moe")
        if self.head_dim is None:
            self.head_dim = (
                self.qk_nope_head_dim + self.qk_rope_head_dim
                if self.is_mla
                else self.hidden_size // max(self.num_attention_heads, 1)
            )

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-latent (DeepSeek-V3 family)."""
        return self.kv_lora_rank > 0

    @property
    def value_head_dim(self) -> int:
        """The width of one head's value (``v_head_dim`` under multi-latent attention, else ``head_dim``)."""
        return self.v_head_dim if self.is_mla else self.kv_channels

    @property
    def kv_channels(self) -> int:
        """The width of one attention head (``head_dim``, resolved from hidden / heads when unset)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // max(self.num_attention_heads, 1)

    def validate(self, prefix: str = "model") -> None:
        """Raise ``ValueError`` naming the offending key when the architecture is inconsistent."""
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(f"{prefix}.family={self.family!r}: supported families are {SUPPORTED_FAMILIES}")
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{prefix}.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        self._validate_experts(prefix)
        if self.family == "deepseek_v3":
            from megatron_zcpo.megatron.deepseek import validate_deepseek

            validate_deepseek(self, prefix)
            return
        if self.is_mla:
            raise ValueError(f"{prefix}.kv_lora_rank={self.kv_lora_rank}: multi-latent attention is deepseek_v3's")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type != "llama3":
                raise ValueError(f"{prefix}.rope_scaling: only rope_type 'llama3' is supported, got {rope_type!r}")
            expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            for key, value in expected.items():
                if key in self.rope_scaling and float(self.rope_scaling[key]) != float(value):
                    raise ValueError(
                        f"{prefix}.rope_scaling.{key}={self.rope_scaling[key]}: megatron-core's llama3 "
                        f"rope scaling fixes it at {value}"
                    )

    def _validate_experts(self, prefix: str) -> None:
        """The mixture-of-experts fields: all unset for a dense model, consistent for an MoE one."""
        moe_family = self.family in MOE_FAMILIES
        if not self.num_experts:
            if moe_family:
                raise ValueError(f"{prefix}.num_experts must be positive for family {self.family!r}")
            return
        if not moe_family:
            raise ValueError(
                f"{prefix}.num_experts={self.num_experts}: family {self.family!r} is dense "
                f"(mixture-of-experts families: {', '.join(MOE_FAMILIES)})"
            )
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {getattr(self, key)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"{prefix}.num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )
        outside = [i for i in self.mlp_only_layers if not 0 <= int(i) < self.num_layers]
        if outside:
            raise ValueError(f"{prefix}.mlp_only_layers {outside} are not layers of a {self.num_layers}-layer model")
        if not any(self.moe_layer_pattern):
            raise ValueError(
                f"{prefix}: decoder_sparse_step={self.decoder_sparse_step} and mlp_only_layers="
                f"{self.mlp_only_layers} leave no mixture-of-experts layer"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"{prefix}.shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed-expert layers."""
        return self.num_experts > 0

    @property
    def moe_layer_pattern(self) -> List[int]:
        """Per layer 1 for a routed-expert MLP, 0 for a dense one (Hugging Face's rule, see the class);
        all 0 for a dense model. megatron-core's ``moe_layer_freq`` takes this list."""
        if not self.is_moe:
            return [0] * self.num_layers
        if self.family == "deepseek_v3":
            return [
                int(i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0) for i in range(self.num_layers)
            ]
        dense = {int(i) for i in self.mlp_only_layers}
        return [int(i not in dense and (i + 1) % self.decoder_sparse_step == 0) for i in range(self.num_layers)]

    def expert_parameters(self) -> int:
        """Parameters of one routed expert (SwiGLU: gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_expert_gate(self) -> bool:
        """Whether the shared expert is sigmoid-gated (Qwen2-MoE; DeepSeek's shared experts are not)."""
        return self.family == "qwen2_moe" and self.shared_expert_intermediate_size > 0

    def attention_parameters(self) -> int:
        """Parameters of one layer's attention with its norms (the two layer norms included)."""
        h = self.hidden_size
        if self.is_mla:
            from megatron_zcpo.megatron.deepseek import mla_parameters

            return mla_parameters(self) + 2 * h
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.num_key_value_heads * self.head_dim
        attn = h * (q + kv) + q * h + ((q + kv) if self.qkv_bias else 0)
        return attn + 2 * h + (2 * self.head_dim if self.qk_layernorm else 0)

    def _layer_parameters(self, active: bool) -> int:
        """Parameters of all layers; ``active``: count only the experts one token runs through."""
        h = self.hidden_size
        moe_layers = sum(self.moe_layer_pattern)
        dense_mlp = 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        moe_mlp = experts * self.expert_parameters() + self.num_experts * h  # + the router
        if self.shared_expert_intermediate_size:
            moe_mlp += 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gate else 0)
        return (
            self.num_layers * self.attention_parameters()
            + (self.num_layers - moe_layers) * dense_mlp
            + moe_layers * moe_mlp
        )

    @property
    def num_parameters(self) -> int:
        """Parameter count of the unpadded model (embeddings counted once when tied; every expert)."""
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self._layer_parameters(active=False) + emb + self.hidden_size

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token runs through: :attr:`num_parameters` with only ``num_experts_per_tok``
        experts per MoE layer (equal to it for a dense model)."""
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self._layer_parameters(active=True) + emb + self.hidden_size


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


# How pipeline_stage_layers names the pipeline size and the first / last stage's layers in errors.
PIPELINE_KEYS = ("parallel.pipeline", "parallel.first_stage_layers", "parallel.last_stage_layers")


def pipeline_stage_layers(
    num_layers: int,
    pipeline: int,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    keys: Tuple[str, str, str] = PIPELINE_KEYS,
) -> List[int]:
    """Transformer layers of each of ``pipeline`` stages, as megatron-core 0.16.1 splits them
    (``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``: the first and
    last stage hold their given counts, the other stages share the rest evenly; none given: all
    stages even). Raises ``ValueError`` naming ``keys`` (the pipeline size, the first and the last
    stage's layers) and a split that works (e.g. 94 layers at PP8: 11 + 6 x 12 + 11)."""
    pipeline_key, first_key, last_key = keys
    uneven = {first_key: first_stage_layers, last_key: last_stage_layers}
    given = {key: value for key, value in uneven.items() if value is not None}
    for key, value in given.items():
        if not 0 < value < num_layers:
            raise ValueError(f"{key}={value} must be between 1 and num_layers - 1 = {num_layers - 1}")
    if pipeline == 1 and given:
        raise ValueError(f"{first_key} / {last_key} need {pipeline_key} > 1")
    middle_stages, middle_layers = pipeline - len(given), num_layers - sum(given.values())
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or middle_layers % max(1, middle_stages):
        problem = (
            f"with {', '.join(f'{key}={value}' for key, value in given.items())} leaves {middle_layers} layers "
            f"to {middle_stages} other stage(s)"
            if given
            else f"does not divide num_layers={num_layers}"
        )
        raise ValueError(f"{pipeline_key}={pipeline} {problem}: {_stage_splits(num_layers, pipeline, keys)}")
    layers = [middle_layers // middle_stages if middle_stages else 0] * pipeline
    if first_stage_layers is not None:
        layers[0] = first_stage_layers
    if last_stage_layers is not None:
        layers[-1] = last_stage_layers
    return layers


def _stage_splits(num_layers: int, pipeline: int, keys: Tuple[str, str, str]) -> str:
    """A layout that splits ``num_layers`` over ``pipeline`` stages, for an error message: the
    middle stages at ceil(num_layers / pipeline) (or fewer), the first and last sharing the rest."""
    _, first_key, last_key = keys
    if num_layers % pipeline == 0:
        return f"the even split of {num_layers // pipeline} per stage works"
    if num_layers < pipeline:
        return f"{pipeline} stages need at least as many layers"
    if pipeline == 2:
        first = (num_layers + 1) // 2
        return f"e.g. {first_key}={first} (last stage {num_layers - first})"
    per_stage = math.ceil(num_layers / pipeline)
    while num_layers - (pipeline - 2) * per_stage < 2:
        per_stage -= 1
    edges = num_layers - (pipeline - 2) * per_stage
    return (
        f"e.g. {first_key}={edges // 2} and {last_key}={edges - edges // 2}, "
        f"{per_stage} in each of the {pipeline - 2} other stages"
    )


def transformer_config(
    model: ModelConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
    moe=None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    **overrides: Any,
):
    """The megatron-core ``TransformerConfig`` for ``model`` at the given parallelism.

    ``first_stage_layers`` / ``last_stage_layers``: uneven pipeline stages
    (:func:`pipeline_stage_layers`, checked here with the config keys named).

    For a mixture-of-experts ``model`` also its MoE fields (:func:`moe_transformer_fields`) at
    ``expert_parallel`` x ``expert_tensor_parallel`` (None: as ``tensor_parallel``), with the
    router's auxiliary losses of ``moe`` (a :class:`~megatron_zcpo.megatron.model.MoETraining`;
    None: its defaults). Multi-latent attention gives megatron-core's ``MLATransformerConfig``
    (:func:`~megatron_zcpo.megatron.deepseek.mla_transformer_fields`).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    on_gpu = has_cuda()
    pipeline_stage_layers(model.num_layers, pipeline_parallel, first_stage_layers, last_stage_layers)
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
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
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
    if model.is_moe:
        kwargs.update(
            moe_transformer_fields(
                model,
                moe or MoETraining(),
                expert_parallel,
                tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel,
            )
        )
    elif expert_parallel != 1:
        raise ValueError(f"parallel.expert={expert_parallel}: the {model.family} model has no experts")
    if recompute:
        kwargs.update(recompute_granularity=recompute)
        if recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    if model.is_mla:
        from megatron_zcpo.megatron.deepseek import mla_transformer_fields

        kwargs.update(mla_transformer_fields(model, context_parallel))
        kwargs.update(overrides)
        return MLATransformerConfig(**kwargs)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_transformer_fields(model: ModelConfig, moe, expert_parallel: int, expert_tensor_parallel: int) -> dict:
    """megatron-core ``TransformerConfig`` fields of a mixture-of-experts ``model`` (``moe``: a MoETraining).

    Hugging Face's Qwen-MoE router (softmax over all experts, top-k, renormalised when
    ``norm_topk_prob``) is megatron's softmax router with top-k on the logits and a softmax over
    the chosen ones (``moe_router_pre_softmax=False``: the same renormalised weights), or, without
    renormalisation, the softmax first (``moe_router_pre_softmax=True``); the router runs in fp32
    (``moe_router_dtype``, as the peers train MoE in bf16). Tokens move between expert-parallel
    ranks by all-to-all (the trainer's micro-batches vary in length, which megatron's all-gather
    dispatcher refuses; gloo has ``all_to_all_single``, so it runs on CPUs too). Experts are
    Transformer Engine's grouped GEMM where TE is installed, else megatron's SequentialMLP.
    Raises ``ValueError`` naming ``parallel.expert`` when the experts do not split evenly.
    """
    if expert_parallel < 1 or model.num_experts % expert_parallel:
        raise ValueError(f"parallel.expert={expert_parallel} must divide the model's num_experts={model.num_experts}")
    if expert_tensor_parallel < 1 or model.moe_intermediate_size % expert_tensor_parallel:
        raise ValueError(
            f"parallel.expert_tensor={expert_tensor_parallel} must divide the model's "
            f"moe_intermediate_size={model.moe_intermediate_size}"
        )
    pattern = model.moe_layer_pattern
    fields = dict(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_intermediate_size,
        moe_router_topk=model.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_grouped_gemm=have_transformer_engine(),
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
    )
    if model.shared_expert_intermediate_size:
        fields.update(
            moe_shared_expert_intermediate_size=model.shared_expert_intermediate_size,
            moe_shared_expert_gate=model.shared_expert_gate,
        )
    if model.family == "deepseek_v3":
        from megatron_zcpo.megatron.deepseek import deepseek_router_fields

        fields.update(deepseek_router_fields(model, moe))
    return fields


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
    Both carry per-head q/k RMSNorms when ``config.qk_layernorm`` (Qwen3), and routed-expert MLPs
    in the layers ``config.moe_layer_freq`` marks (TE: grouped-GEMM experts; local: SequentialMLP)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_zcpo.megatron.local_spec import local_block_spec

    if use_te is None:
        use_te = have_transformer_engine()
    if use_te and config.num_moe_experts:
        return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return local_block_spec(config)


def _define_router_gemm_without_te() -> None:
    """megatron-core 0.16.1's router GEMM tests ``te_general_gemm is not None``, but the name is only
    bound when Transformer Engine imports: without TE every MoE router raises NameError. Binding it to
    None selects the function's own torch.mm path (what the test intends)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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

    if config.num_moe_experts:
        _define_router_gemm_without_te()
    if getattr(config, "multi_latent_attention", False):
        from megatron_zcpo.megatron.deepseek import declare_transformer_engine_absent_to_mla

        declare_transformer_engine_absent_to_mla()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    rope = {} if model.is_mla else model.rope_scaling or {}  # multi-latent attention has its own (YaRN)
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
