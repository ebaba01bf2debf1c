"""DeepSeek-V3-class architectures (DeepSeek-V3/R1, Kimi-K2, Moonlight) in megatron-core 0.16.1 terms:
multi-latent attention with YaRN, and DeepSeekMoE's router.

What each Hugging Face field becomes (transformers' ``DeepseekV3ForCausalLM`` is the reference):

- Multi-latent attention is megatron-core's ``MLATransformerConfig``: ``q_lora_rank`` (None: one
  query projection), ``kv_lora_rank``, ``qk_head_dim`` = ``qk_nope_head_dim``,
  ``qk_pos_emb_head_dim`` = ``qk_rope_head_dim``, ``v_head_dim``; the latent RMSNorms are
  ``qk_layernorm``. Both libraries rotate the rope channels in DeepSeek's interleaved pairs
  (megatron's rope de-interleaves under ``multi_latent_attention``, transformers' under
  ``rope_interleave``), so weights copy as they are.
- YaRN (``rope_scaling.rope_type`` yarn): ``factor``, ``original_max_position_embeddings``,
  ``beta_fast``, ``beta_slow`` as megatron's ``rotary_scaling_factor`` etc. The attention-scale
  correction is YaRN's mscale: transformers multiplies the softmax scale by mscale(factor,
  ``mscale_all_dim``)^2 and cos/sin by mscale(factor, ``mscale``) / mscale(factor,
  ``mscale_all_dim``) when both are set, else by mscale(factor, 1); megatron by the same with its
  ``mscale`` / ``mscale_all_dim`` (0: no softmax correction), so a config with only one of them is
  passed on as (1, 0), which is what transformers computes for it.
- The router: sigmoid scores, the correction bias added for the choice only (megatron's
  ``moe_router_enable_expert_bias``: a float32 buffer ``expert_bias``), group-limited top-k
  (``n_group`` / ``topk_group``: megatron scores a group by the sum of its top (top-k / topk_group)
  experts, transformers by its top 2, so a grouped router needs top-k = 2 x topk_group, as
  DeepSeek-V3's 8 = 2 x 4), the chosen scores renormalised (megatron always does, so
  ``norm_topk_prob`` must be true) and scaled by ``routed_scaling_factor``
  (``moe_router_topk_scaling_factor``). The bias is frozen during RL unless
  ``train.moe.expert_bias_update_rate`` says otherwise (:class:`~megatron_zcpo.megatron.model.MoETraining`
  says why).
"""

from __future__ import annotations

from typing import Optional

YARN_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
YARN_MSCALE_KEYS = ("mscale", "mscale_all_dim")
ROPE_TYPES = ("yarn",)  # plus none: plain RoPE over the rope channels


def _positive(model, prefix: str, *keys: str) -> None:
    for key in keys:
        if not int(getattr(model, key)) > 0:
            raise ValueError(f"{prefix}.{key} must be positive for multi-latent attention, got {getattr(model, key)}")


def validate_deepseek(model, prefix: str = "model") -> None:
    """Raise ``ValueError`` naming the key when a ``deepseek_v3`` :class:`ModelConfig` is inconsistent
    or asks for what megatron-core 0.16.1 computes differently from transformers (module docstring)."""
    _positive(model, prefix, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if model.q_lora_rank is not None and not model.q_lora_rank > 0:
        raise ValueError(f"{prefix}.q_lora_rank must be positive or null, got {model.q_lora_rank}")
    if model.qk_rope_head_dim % 2:
        raise ValueError(f"{prefix}.qk_rope_head_dim={model.qk_rope_head_dim} must be even (rotated in pairs)")
    if model.head_dim != model.qk_nope_head_dim + model.qk_rope_head_dim:
        raise ValueError(
            f"{prefix}.head_dim={model.head_dim}: multi-latent attention's query/key head is "
            f"qk_nope_head_dim + qk_rope_head_dim = {model.qk_nope_head_dim + model.qk_rope_head_dim}"
        )
    if model.num_key_value_heads != model.num_attention_heads:
        raise ValueError(
            f"{prefix}.num_key_value_heads={model.num_key_value_heads}: multi-latent attention expands its "
            f"latent into every one of the num_attention_heads={model.num_attention_heads} heads"
        )
    if model.qkv_bias:
        raise ValueError(f"{prefix}.qkv_bias: DeepSeek-V3's attention_bias is not supported")
    _validate_yarn(model.rope_scaling, prefix)
    _validate_router(model, prefix)


def _validate_yarn(scaling: Optional[dict], prefix: str) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{prefix}.rope_scaling: multi-latent attention takes rope_type 'yarn' or none, got {rope_type!r}"
        )
    unknown = sorted(set(scaling) - set(YARN_KEYS) - set(YARN_MSCALE_KEYS))
    if unknown:
        raise ValueError(f"{prefix}.rope_scaling: {unknown} not supported (megatron-core's YaRN takes {YARN_KEYS[2:]})")
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None or not float(scaling[key]) > 0:
            raise ValueError(f"{prefix}.rope_scaling.{key} must be positive, got {scaling.get(key)}")


def _validate_router(model, prefix: str) -> None:
    if model.router_score_function != "sigmoid":
        raise ValueError(
            f"{prefix}.router_score_function={model.router_score_function!r}: DeepSeek-V3's router is 'sigmoid'"
        )
    if model.num_experts_per_tok > 1 and not model.norm_topk_prob:
        raise ValueError(
            f"{prefix}.norm_topk_prob=false: megatron-core's sigmoid router always renormalises the chosen "
            f"experts' scores"
        )
    if not model.routed_scaling_factor > 0:
        raise ValueError(f"{prefix}.routed_scaling_factor must be positive, got {model.routed_scaling_factor}")
    groups, chosen = model.router_num_groups, model.router_group_topk
    if groups < 1 or model.num_experts % groups:
        raise ValueError(f"{prefix}.router_num_groups={groups} must divide num_experts={model.num_experts}")
    if not 1 <= chosen <= groups:
        raise ValueError(f"{prefix}.router_group_topk={chosen} must be between 1 and router_num_groups={groups}")
    if chosen < groups and model.num_experts_per_tok != 2 * chosen:
        raise ValueError(
            f"{prefix}.router_group_topk={chosen}: transformers scores an expert group by its top 2 experts, "
            f"megatron-core by its top num_experts_per_tok / router_group_topk = "
            f"{model.num_experts_per_tok / chosen:g}: they agree only when num_experts_per_tok = 2 x router_group_topk"
        )
    if not 0 <= model.first_k_dense_replace < model.num_layers:
        raise ValueError(
            f"{prefix}.first_k_dense_replace={model.first_k_dense_replace} must leave a mixture-of-experts layer "
            f"of the {model.num_layers}"
        )
    if model.moe_layer_freq < 1:
        raise ValueError(f"{prefix}.moe_layer_freq must be at least 1, got {model.moe_layer_freq}")
    if model.shared_expert_intermediate_size % model.moe_intermediate_size:
        raise ValueError(
            f"{prefix}.shared_expert_intermediate_size={model.shared_expert_intermediate_size} must be "
            f"n_shared_experts x moe_intermediate_size={model.moe_intermediate_size}"
        )
    if model.mlp_only_layers or model.decoder_sparse_step != 1:
        raise ValueError(
            f"{prefix}: mlp_only_layers / decoder_sparse_step are Qwen-MoE's; DeepSeek-V3's dense layers are "
            f"first_k_dense_replace and moe_layer_freq"
        )


def mla_parameter_split(model) -> tuple:
    """(parameters split over TP, parameters every TP rank holds) of one layer's multi-latent
    attention: the up-projections (or the direct query projection) and the output projection are
    column / row parallel; the latent down-projections (duplicated ``Linear`` on both layer specs)
    and the latent RMSNorms are whole on every rank."""
    h, heads = model.hidden_size, model.num_attention_heads
    latent, rope = model.kv_lora_rank, model.qk_rope_head_dim
    up = latent * heads * (model.qk_nope_head_dim + model.v_head_dim) + heads * model.v_head_dim * h
    whole = h * (latent + rope) + latent
    if model.q_lora_rank:
        up += model.q_lora_rank * heads * model.head_dim
        whole += h * model.q_lora_rank + model.q_lora_rank
    else:
        up += h * heads * model.head_dim
    return up, whole


def mla_parameters(model) -> int:
    """Parameters of one layer's multi-latent attention (:func:`mla_parameter_split`, both parts)."""
    return sum(mla_parameter_split(model))


def latent_cache_elements(model) -> int:
    """Elements one token keeps per layer in a multi-latent-attention KV cache (SGLang's MLA pool):
    the normalised key/value latent and the rotated rope key, ``kv_lora_rank + qk_rope_head_dim``."""
    return model.kv_lora_rank + model.qk_rope_head_dim


def yarn_fields(scaling: Optional[dict]) -> dict:
    """megatron-core's ``MLATransformerConfig`` RoPE fields of ``rope_scaling`` (None: plain RoPE)."""
    if scaling is None:
        return dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    both = bool(mscale) and bool(mscale_all_dim)
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32),  # transformers' defaults for an unset / 0 value
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=float(mscale) if both else 1.0,
        mscale_all_dim=float(mscale_all_dim or 0.0),
    )


def mla_transformer_fields(model, context_parallel: int = 1) -> dict:
    """The ``MLATransformerConfig`` fields of a multi-latent-attention ``model`` (module docstring).
    Context parallelism is refused (the local spec's CP path is not checked with multi-latent
    attention): ``ValueError`` naming ``parallel.context``."""
    if context_parallel != 1:
        raise ValueError(
            f"parallel.context={context_parallel}: context parallelism is not supported with multi-latent attention"
        )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        qk_layernorm=True,  # the latent RMSNorms (q_a_layernorm, kv_a_layernorm)
        num_query_groups=model.num_attention_heads,
        rotary_base=float(model.rope_theta),
        **yarn_fields(model.rope_scaling),
    )


def deepseek_router_fields(model, moe) -> dict:
    """megatron-core's router fields of DeepSeekMoE (module docstring); ``moe``: the run's MoETraining,
    whose ``expert_bias_update_rate`` (default 0: frozen) moves the correction bias after every step."""
    grouped = model.router_group_topk < model.router_num_groups
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=model.router_expert_bias,
        moe_router_bias_update_rate=moe.expert_bias_update_rate,
        moe_router_num_groups=model.router_num_groups if grouped else None,
        moe_router_group_topk=model.router_group_topk if grouped else None,
        moe_router_topk_scaling_factor=model.routed_scaling_factor,
    )


def declare_transformer_engine_absent_to_mla() -> None:
    """megatron-core 0.16.1's ``multi_latent_attention`` sets ``HAVE_TE`` when its Transformer Engine
    import succeeds, which it does without TE too (megatron's extensions module stands in mocks), and
    then tests ``isinstance(linear_proj, TELinear)`` against a mock: every MLA layer raises TypeError.
    Without TE installed, ``HAVE_TE`` False is what that test means (the local spec's linears)."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
