"""DeepSeek-V3-class checkpoints (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2, Moonlight): their
config.json fields and tensor names against :class:`ModelConfig` and megatron-core's local-spec names.

Tensors (all renames; megatron-core's MLA keeps Hugging Face's per-head layouts, see
:mod:`megatron_zcpo.megatron.deepseek`):

| Hugging Face (``model.layers.{i}.``) | Megatron (``decoder.layers.{i}.``) |
|---|---|
| self_attn.q_a_proj / q_a_layernorm / q_b_proj (``q_lora_rank``) | self_attention.linear_q_down_proj / q_layernorm / linear_q_up_proj |
| self_attn.q_proj (no ``q_lora_rank``) | self_attention.linear_q_proj |
| self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj | self_attention.linear_kv_down_proj / kv_layernorm / linear_kv_up_proj |
| self_attn.o_proj | self_attention.linear_proj |
| mlp.gate.weight / mlp.gate.e_score_correction_bias | mlp.router.weight / mlp.router.expert_bias |
| mlp.shared_experts.{gate,up,down}_proj | mlp.shared_experts.linear_fc1 ([gate; up]) / linear_fc2 |

Multi-token-prediction layers (``num_nextn_predict_layers``: ``model.layers.{L + j}.*`` after the
L layers) are not part of the policy: :func:`mtp_layer_of` finds them, and the converters drop or
keep them as told (:mod:`megatron_zcpo.convert.checkpoint`).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # Kimi-K2's config.json names its DeepseekV3ForCausalLM "kimi_k2"
REQUIRED = (
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
MTP_LAYERS = "num_nextn_predict_layers"

Table = Dict[str, Tuple[Tuple[str, ...], str]]  # Megatron suffix -> (Hugging Face suffixes, layout)

QUERY_LATENT: Table = {
    "self_attention.linear_q_down_proj.weight": (("self_attn.q_a_proj.weight",), "copy"),
    "self_attention.q_layernorm.weight": (("self_attn.q_a_layernorm.weight",), "copy"),
    "self_attention.linear_q_up_proj.weight": (("self_attn.q_b_proj.weight",), "copy"),
}
QUERY_DIRECT: Table = {"self_attention.linear_q_proj.weight": (("self_attn.q_proj.weight",), "copy")}
KEY_VALUE: Table = {
    "self_attention.linear_kv_down_proj.weight": (("self_attn.kv_a_proj_with_mqa.weight",), "copy"),
    "self_attention.kv_layernorm.weight": (("self_attn.kv_a_layernorm.weight",), "copy"),
    "self_attention.linear_kv_up_proj.weight": (("self_attn.kv_b_proj.weight",), "copy"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "copy"),
}
NORMS: Table = {
    "input_layernorm.weight": (("input_layernorm.weight",), "copy"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "copy"),
}
ROUTER_BIAS: Table = {"mlp.router.expert_bias": (("mlp.gate.e_score_correction_bias",), "copy")}
SHARED_EXPERTS: Table = {
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        "gate_up",
    ),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_experts.down_proj.weight",), "copy"),
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def attention_tensors(model) -> Table:
    """Megatron suffix -> (Hugging Face suffixes, layout) of one layer's norms and multi-latent attention."""
    return {**NORMS, **(QUERY_LATENT if model.q_lora_rank else QUERY_DIRECT), **KEY_VALUE}


def moe_extra_tensors(model) -> Table:
    """The routed layers' tensors besides the router weight and the experts: the correction bias
    (``noaux_tc``) and the shared experts."""
    table: Table = dict(ROUTER_BIAS) if model.router_expert_bias else {}
    if model.shared_expert_intermediate_size:
        table.update(SHARED_EXPERTS)
    return table


def hf_shapes(model) -> Dict[str, Tuple[int, ...]]:
    """Hugging Face suffix (``model.layers.{i}.`` stripped) -> shape, of the tensors above."""
    h, heads, latent = model.hidden_size, model.num_attention_heads, model.kv_lora_rank
    qk, q_rank, shared = model.head_dim, model.q_lora_rank or 0, model.shared_expert_intermediate_size
    return {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_a_proj.weight": (q_rank, h),
        "self_attn.q_a_layernorm.weight": (q_rank,),
        "self_attn.q_b_proj.weight": (heads * qk, q_rank),
        "self_attn.q_proj.weight": (heads * qk, h),
        "self_attn.kv_a_proj_with_mqa.weight": (latent + model.qk_rope_head_dim, h),
        "self_attn.kv_a_layernorm.weight": (latent,),
        "self_attn.kv_b_proj.weight": (heads * (model.qk_nope_head_dim + model.v_head_dim), latent),
        "self_attn.o_proj.weight": (h, heads * model.v_head_dim),
        "mlp.gate.e_score_correction_bias": (model.num_experts,),
        "mlp.shared_experts.gate_proj.weight": (shared, h),
        "mlp.shared_experts.up_proj.weight": (shared, h),
        "mlp.shared_experts.down_proj.weight": (h, shared),
    }


def check_features(config: dict) -> None:
    """Raise ``ValueError`` naming the config.json field DeepSeek-V3's conversion does not support."""
    if config.get("attention_bias"):
        raise ValueError("config.json attention_bias=True: DeepSeek-V3's attention biases are not supported")
    if config.get("rope_interleave", True) is False:
        raise ValueError(
            "config.json rope_interleave=False: megatron-core's multi-latent attention rotates interleaved pairs"
        )
    for key, supported in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if config.get(key, supported) != supported:
            raise ValueError(f"config.json {key}={config[key]!r}: only {supported!r} (DeepSeek-V3's router) converts")
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if scaling.get("truncate", True) is False or scaling.get("attention_factor") is not None:
        raise ValueError(
            "config.json rope_scaling truncate=False / attention_factor: megatron-core's YaRN derives both"
        )


def fields_from_hf(config: dict) -> dict:
    """The :class:`ModelConfig` fields of a DeepSeek-V3 config.json beyond the common ones."""
    experts = int(config["moe_intermediate_size"])
    q_lora_rank = config.get("q_lora_rank")
    return dict(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        head_dim=int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"]),
        num_experts=int(config["n_routed_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=experts,
        shared_expert_intermediate_size=int(config.get("n_shared_experts") or 0) * experts,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(config.get("moe_layer_freq") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        router_score_function=str(config.get("scoring_func", "sigmoid")),
        router_expert_bias=True,  # noaux_tc (check_features): transformers' class always has the bias
        router_num_groups=int(config.get("n_group") or 1),
        router_group_topk=int(config.get("topk_group") or 1),
    )


# Fields DeepSeek's config.json has and transformers' DeepseekV3Config does not write: written back
# when the original had them or their value is not the default.
_OPTIONAL_DEFAULTS = {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def fields_to_hf(model, present=()) -> dict:
    """The config.json fields :func:`fields_from_hf` reads, from ``model``; ``present``: the keys of
    the config written over (the optional fields of :data:`_OPTIONAL_DEFAULTS` stay out unless there
    or not at their default)."""
    fields = dict(
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        n_routed_experts=model.num_experts,
        num_experts_per_tok=model.num_experts_per_tok,
        moe_intermediate_size=model.moe_intermediate_size,
        n_shared_experts=model.shared_expert_intermediate_size // model.moe_intermediate_size,
        norm_topk_prob=model.norm_topk_prob,
        first_k_dense_replace=model.first_k_dense_replace,
        moe_layer_freq=model.moe_layer_freq,
        routed_scaling_factor=model.routed_scaling_factor,
        scoring_func=model.router_score_function,
        topk_method="noaux_tc",
        n_group=model.router_num_groups,
        topk_group=model.router_group_topk,
    )
    return {
        key: value
        for key, value in fields.items()
        if key not in _OPTIONAL_DEFAULTS or key in present or value != _OPTIONAL_DEFAULTS[key]
    }


def mtp_layer_of(hf_name: str, config: dict) -> Optional[int]:
    """The multi-token-prediction layer (0-based among them) a Hugging Face tensor belongs to, or
    None: ``model.layers.{num_hidden_layers + j}.*`` for j < ``num_nextn_predict_layers``."""
    match = _HF_LAYER.match(hf_name)
    if not match or config.get("model_type") not in MODEL_TYPES:
        return None
    extra = int(match.group(1)) - int(config["num_hidden_layers"])
    return extra if 0 <= extra < int(config.get(MTP_LAYERS) or 0) else None


def sglang_load_partner(hf_name: str) -> Optional[str]:
    """The tensor SGLang's DeepSeek-V3 loader must receive in the same ``load_weights`` call as
    ``hf_name``, or None. Read from ``srt/models/deepseek_v2.py`` of 0.5.3.post3 and
    ``deepseek_common/deepseek_weight_loader.py`` of 0.5.23: with a query latent it loads
    ``q_a_proj`` and ``kv_a_proj_with_mqa`` into one fused ``fused_qkv_a_proj_with_mqa``, caching
    the first until the second arrives in a dict local to the call, so a pair split over two weight
    buckets (one call each, for every transport but the disk) is never loaded, silently. The
    absorbed ``w_kc`` / ``w_vc`` are rebuilt from ``kv_b_proj`` by the same call (``post_load_weights``
    on the layers whose ``kv_b_proj`` it received): pushing ``kv_b_proj`` is all they need."""
    if hf_name.endswith("self_attn.q_a_proj.weight"):
        return hf_name.replace("q_a_proj", "kv_a_proj_with_mqa")
    return None
