"""Hugging Face <-> Megatron tensor names, layouts and model configs (Qwen2/Qwen2.5, Qwen3, Llama, Qwen2/3-MoE,
DeepSeek-V3: its own tables in :mod:`megatron_zcpo.convert.deepseek`).

Megatron tensors here are *global* ones, as :mod:`megatron_zcpo.megatron.weights` defines them:
local-spec names with global layer indices, TP=1 shapes, and the true (unpadded) vocabulary.
Three layouts differ from Hugging Face's:
- ``linear_qkv`` fuses q/k/v (and their biases) in megatron-core's interleaved per-query-group
  order: for each of the ``num_key_value_heads`` groups, that group's query heads, then its key
  head, then its value head;
- ``linear_fc1`` stacks SwiGLU's ``[gate_proj; up_proj]`` along the output dimension;
- tied embeddings have no ``lm_head.weight``: the output layer is the embedding.
Everything else is a rename (Qwen3's per-head ``q_norm`` / ``k_norm`` are megatron-core's
``q_layernorm`` / ``k_layernorm``). Mixture-of-experts layers: the router ``mlp.gate`` is
``mlp.router``; expert e (global index, whatever expert-parallel rank holds it) is
``mlp.experts.local_experts.{e}`` with the same SwiGLU layout as a dense MLP; Qwen2-MoE's
``mlp.shared_expert`` / ``mlp.shared_expert_gate`` are ``mlp.shared_experts`` and its ``gate_weight``. All functions take and return tensors one at a time, so a whole
model streams through them (the checkpoint tools, the rollout weight push); they work on meta
tensors too, which checks a whole checkpoint's names and shapes without reading any data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_zcpo.convert import deepseek
from megatron_zcpo.megatron.model import MOE_FAMILIES, ModelConfig
from megatron_zcpo.megatron.weights import EMBEDDING, TIED_OUTPUT

OUTPUT_LAYER = TIED_OUTPUT  # "output_layer.weight": the untied output layer has the same name
FINAL_NORM = "decoder.final_layernorm.weight"


@dataclass(frozen=True)
class HFFamily:
    """How one Hugging Face architecture maps onto :class:`ModelConfig` (README: adding a family)."""

    family: str  # ModelConfig.family
    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"[0]
    qkv_bias: Optional[bool]  # fixed by the architecture (Qwen2: True); None: config "attention_bias"
    qk_layernorm: bool = False  # per-head q/k RMSNorm (Qwen3's q_norm / k_norm)
    # config.json fields this family needs beyond _REQUIRED_FIELDS (Qwen3's head_dim defaults to
    # 128 in transformers, not hidden/heads, so it must be stated)
    required: Tuple[str, ...] = ()
    shared_expert: bool = False  # Qwen2-MoE's sigmoid-gated shared expert
    aliases: Tuple[str, ...] = ()  # other config.json model_types of the same architecture


# config.json fields of a mixture-of-experts family (the expert count is "num_experts" on the hub and
# "num_local_experts" as transformers>=5 writes it: see _num_experts).
_MOE_REQUIRED = ("num_experts_per_tok", "moe_intermediate_size")

FAMILIES: Dict[str, HFFamily] = {
    family.family: family
    for family in (
        HFFamily("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True),
        # Qwen3's attention_bias would also put a bias on o_proj: refused, so fixed at False.
        HFFamily("qwen3", "qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_layernorm=True, required=("head_dim",)),
        HFFamily("llama", "llama", "LlamaForCausalLM", qkv_bias=None),
        HFFamily(
            "qwen3_moe",
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            qkv_bias=False,
            qk_layernorm=True,
            required=("head_dim",) + _MOE_REQUIRED,
        ),
        HFFamily(
            "qwen2_moe",
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            qkv_bias=True,
            required=_MOE_REQUIRED + ("shared_expert_intermediate_size",),
            shared_expert=True,
        ),
        HFFamily(
            "deepseek_v3",
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            qkv_bias=False,
            required=deepseek.REQUIRED,
            aliases=deepseek.MODEL_TYPES[1:],
        ),
    )
}

# config.json fields without which the architecture is unknown.
_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)

# Per layer: Megatron suffix -> (Hugging Face suffixes, layout). Attention and norms in every layer:
_LAYER_TENSORS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "copy"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "copy"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "copy"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "copy"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "copy"),
}
# ... a dense MLP in dense layers:
_DENSE_MLP_TENSORS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "copy"),
}
# ... or the router, one SwiGLU MLP per expert ({e}: the global expert index) and a shared expert:
_ROUTER = {"mlp.router.weight": (("mlp.gate.weight",), "copy")}
_EXPERT_TENSORS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "mlp.experts.local_experts.{e}.linear_fc1.weight": (
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "gate_up",
    ),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": (("mlp.experts.{e}.down_proj.weight",), "copy"),
}
_SHARED_EXPERT_TENSORS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "gate_up",
    ),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_expert.down_proj.weight",), "copy"),
    "mlp.shared_experts.gate_weight": (("mlp.shared_expert_gate.weight",), "copy"),
}
_MODEL_TENSORS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    EMBEDDING: (("model.embed_tokens.weight",), "copy"),
    FINAL_NORM: (("model.norm.weight",), "copy"),
    OUTPUT_LAYER: (("lm_head.weight",), "copy"),
}
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MEGATRON_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

# Hugging Face tensors that carry no weights Megatron needs (old Llama checkpoints store the
# rotary inverse frequencies, which both sides recompute from rope_theta).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- model configs


def _family_of(config: dict) -> HFFamily:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    supported = {model_type: f for f in FAMILIES.values() for model_type in (f.model_type, *f.aliases)}
    if model_type is None:
        raise KeyError(
            f"config.json has no 'model_type' (architectures={architectures}); supported: {sorted(supported)}"
        )
    family = supported.get(model_type)
    if family is None:
        raise ValueError(
            f"config.json model_type={model_type!r} (architectures={architectures}) is not "
            f"supported; supported model types: {sorted(supported)}"
        )
    for architecture in architectures:
        if architecture != family.architecture:
            raise ValueError(
                f"config.json architectures={architectures}: model_type {model_type!r} "
                f"is converted as {family.architecture}, not {architecture}"
            )
    return family


def _rope_from_hf(config: dict) -> Tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from transformers<5 fields or transformers>=5 ``rope_parameters``."""
    parameters = config.get("rope_parameters")
    if parameters is not None:
        theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = dict(parameters)
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config.get("rope_scaling") or {})
    scaling.pop("rope_theta", None)  # kept in ModelConfig.rope_theta
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _check_supported_features(config: dict, family: HFFamily) -> None:
    if family.family == "deepseek_v3":
        deepseek.check_features(config)
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={config['hidden_act']!r}: only SwiGLU (silu) MLPs convert")
    if config.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=True: MLP biases are not supported")
    if family.qkv_bias is not True and config.get("attention_bias"):
        # Llama's and Qwen3's attention_bias also put a bias on o_proj, which the Megatron model lacks.
        raise ValueError(
            f"config.json attention_bias=True: {family.architecture} then has a bias on o_proj, which is not supported"
        )
    experts = [key for key in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(key)]
    if experts and family.family not in MOE_FAMILIES:
        raise ValueError(
            f"config.json {experts[0]}={config[experts[0]]}: mixture-of-experts fields in a dense "
            f"{family.model_type} config (mixture-of-experts models convert as {' / '.join(MOE_FAMILIES)})"
        )
    if family.qkv_bias is True and config.get("qkv_bias", True) is False:
        raise ValueError(f"config.json qkv_bias=False: {family.architecture} is converted with its q/k/v biases")
    if config.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=True: sliding-window attention is not supported")
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"config.json layer_types={sorted(layer_types)}: only full attention is supported")


def model_config_from_hf(config: dict) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` (as a dict).

    Raises ``KeyError`` naming a missing required field (Qwen3: also ``head_dim``) and ``ValueError``
    naming an unsupported architecture, model type or feature (mixture-of-experts, non-SwiGLU MLP,
    biases beyond Qwen2's q/k/v, sliding windows, rope scaling other than Llama-3's).
    """
    family = _family_of(config)
    missing = [key for key in _REQUIRED_FIELDS + family.required if config.get(key) is None]
    if missing:
        raise KeyError(f"config.json ({family.model_type}) lacks required field(s) {missing}")
    _check_supported_features(config, family)
    theta, scaling = _rope_from_hf(config)
    heads = int(config["num_attention_heads"])
    fields = dict(
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        **_moe_fields_from_hf(config, family),
    )
    if family.family == "deepseek_v3":  # its head_dim (transformers writes the rope channels) is derived
        fields.update(deepseek.fields_from_hf(config))
    model = ModelConfig(
        family=family.family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        max_position_embeddings=int(config["max_position_embeddings"]),
        rope_theta=theta,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias if family.qkv_bias is not None else bool(config.get("attention_bias", False)),
        qk_layernorm=family.qk_layernorm,
        rope_scaling=scaling,
        init_method_std=float(config.get("initializer_range", 0.02)),
        **fields,
    )
    model.validate(prefix="config.json")
    return model


def _num_experts(config: dict) -> Optional[int]:
    """The routed-expert count: "num_experts" (the hub's configs) or "num_local_experts" (transformers>=5)."""
    value = config.get("num_experts", config.get("num_local_experts"))
    return None if value is None else int(value)


def _moe_fields_from_hf(config: dict, family: HFFamily) -> dict:
    """The :class:`ModelConfig` mixture-of-experts fields of a config.json ({} for a dense family)."""
    if family.family not in ("qwen2_moe", "qwen3_moe"):  # DeepSeek's: deepseek.fields_from_hf
        return {}
    if not _num_experts(config):
        raise KeyError(f"config.json ({family.model_type}) lacks required field 'num_experts' (or 'num_local_experts')")
    return dict(
        num_experts=_num_experts(config),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),  # transformers' default for both families
        decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
        mlp_only_layers=[int(i) for i in config.get("mlp_only_layers") or []],
        shared_expert_intermediate_size=int(config["shared_expert_intermediate_size"]) if family.shared_expert else 0,
    )


def hf_config_from_model_config(model: ModelConfig, base: Optional[dict] = None) -> dict:
    """A Hugging Face ``config.json`` dict for ``model``.

    ``base`` (e.g. the original config.json) supplies every field the model does not determine
    (token ids, dtype, transformers version, ...) and the rope style: transformers>=5
    ``rope_parameters`` when ``base`` has it, else ``rope_theta`` + ``rope_scaling``. Raises
    ``ValueError`` when ``base`` belongs to another family or the model cannot be expressed.
    """
    family = FAMILIES[model.family]
    if base is not None and base.get("model_type", family.model_type) not in (family.model_type, *family.aliases):
        raise ValueError(
            f"base config model_type={base.get('model_type')!r} does not match "
            f"family {model.family!r} ({family.model_type})"
        )
    config = (
        dict(base)
        if base is not None
        else {"architectures": [family.architecture], "model_type": family.model_type, "hidden_act": "silu"}
    )
    config.update(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.rms_norm_eps,
        tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.init_method_std,
    )
    if model.family == "deepseek_v3":  # head_dim derived (deepseek.fields_from_hf), base's kept
        config.update(deepseek.fields_to_hf(model, present=set(config)))
    elif (
        "head_dim" in config
        or "head_dim" in family.required
        or model.head_dim != model.hidden_size // model.num_attention_heads
    ):
        config["head_dim"] = model.head_dim
    if family.qkv_bias is not None and bool(model.qkv_bias) != family.qkv_bias:
        raise ValueError(
            f"model.qkv_bias={model.qkv_bias}: {family.architecture} always has qkv_bias={family.qkv_bias}"
        )
    if family.qkv_bias is not True:
        config["attention_bias"] = bool(model.qkv_bias)
    if bool(model.qk_layernorm) != family.qk_layernorm:
        raise ValueError(
            f"model.qk_layernorm={model.qk_layernorm}: {family.architecture} always has "
            f"qk_layernorm={family.qk_layernorm}"
        )
    if model.is_moe and model.family != "deepseek_v3":
        expert_key = (
            "num_local_experts" if "num_local_experts" in config and "num_experts" not in config else "num_experts"
        )
        config.update(
            {expert_key: model.num_experts},
            num_experts_per_tok=model.num_experts_per_tok,
            moe_intermediate_size=model.moe_intermediate_size,
            norm_topk_prob=model.norm_topk_prob,
            decoder_sparse_step=model.decoder_sparse_step,
            mlp_only_layers=list(model.mlp_only_layers),
        )
        if family.shared_expert:
            config["shared_expert_intermediate_size"] = model.shared_expert_intermediate_size
    scaling = dict(model.rope_scaling) if model.rope_scaling else None
    if "rope_parameters" in config:
        config["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": model.rope_theta}
    else:
        config["rope_theta"] = model.rope_theta
        if scaling is not None or "rope_scaling" in config:
            config["rope_scaling"] = scaling
    return config


# ----------------------------------------------------------------------------- tensor names


def _layer_tensors(layer: int, model: ModelConfig) -> Dict[str, Tuple[Tuple[str, ...], str]]:
    """Megatron suffix -> (Hugging Face suffixes, layout) of every tensor layer ``layer`` of ``model`` has,
    in model order (biases and q/k norms only where the model has them; a dense MLP or the experts)."""
    if model.is_mla:
        tensors = deepseek.attention_tensors(model)
    else:
        tensors = {
            suffix: spec
            for suffix, spec in _LAYER_TENSORS.items()
            if not (suffix.endswith(".bias") and not model.qkv_bias)
            and not (suffix.endswith(("q_layernorm.weight", "k_layernorm.weight")) and not model.qk_layernorm)
        }
    if not model.moe_layer_pattern[layer]:
        tensors.update(_DENSE_MLP_TENSORS)
        return tensors
    tensors.update(_ROUTER)
    for expert in range(model.num_experts):
        for suffix, (hf_suffixes, layout) in _EXPERT_TENSORS.items():
            tensors[suffix.format(e=expert)] = (tuple(hf.format(e=expert) for hf in hf_suffixes), layout)
    if model.family == "deepseek_v3":
        tensors.update(deepseek.moe_extra_tensors(model))
    elif model.shared_expert_intermediate_size:
        tensors.update(_SHARED_EXPERT_TENSORS)
    return tensors


def megatron_tensor_names(model: ModelConfig) -> List[str]:
    """Global Megatron tensor names of ``model`` in model order (no output layer when tied)."""
    names = [EMBEDDING]
    for layer in range(model.num_layers):
        names.extend(f"decoder.layers.{layer}.{suffix}" for suffix in _layer_tensors(layer, model))
    names.append(FINAL_NORM)
    if not model.tie_word_embeddings:
        names.append(OUTPUT_LAYER)
    return names


def _hf_names_and_layout(name: str, model: ModelConfig) -> Tuple[Tuple[str, ...], str]:
    """The Hugging Face tensors of one global Megatron tensor and how they combine."""
    if name in _MODEL_TENSORS:
        hf_names, layout = _MODEL_TENSORS[name]
        if name == OUTPUT_LAYER and model.tie_word_embeddings:
            return (), layout  # the output layer is the embedding
        return hf_names, layout
    match = _MEGATRON_LAYER.match(name)
    if match and int(match.group(1)) < model.num_layers:
        layer, suffix = int(match.group(1)), match.group(2)
        tensors = _layer_tensors(layer, model)
        if suffix in tensors:
            hf_suffixes, layout = tensors[suffix]
            return tuple(f"model.layers.{layer}.{hf}" for hf in hf_suffixes), layout
        if (
            suffix in _LAYER_TENSORS
            or suffix in _DENSE_MLP_TENSORS
            or suffix in _ROUTER
            or _MEGATRON_EXPERT.match(suffix)
        ):
            raise KeyError(
                f"Megatron tensor {name!r}: the model has no such tensor (qkv_bias={model.qkv_bias}, "
                f"qk_layernorm={model.qk_layernorm}, layer {layer} "
                f"{'mixture-of-experts' if model.moe_layer_pattern[layer] else 'dense'}, "
                f"num_experts={model.num_experts})"
            )
    raise KeyError(
        f"Megatron tensor {name!r} has no Hugging Face counterpart in a {model.num_layers}-layer {model.family} model"
    )


def hf_names_of(name: str, model: ModelConfig) -> Tuple[str, ...]:
    """The Hugging Face tensors the global Megatron tensor ``name`` holds (fused ones: several; a
    tied output layer: none); ``KeyError`` for a name ``model`` does not have."""
    return _hf_names_and_layout(name, model)[0]


def hf_tensor_names(model: ModelConfig) -> List[str]:
    """The Hugging Face tensor names a checkpoint of ``model`` holds, in model order."""
    return [hf for name in megatron_tensor_names(model) for hf in _hf_names_and_layout(name, model)[0]]


def is_ignored_hf_tensor(hf_name: str, model: ModelConfig) -> bool:
    """Whether a Hugging Face tensor outside :func:`hf_tensor_names` is safe to drop.

    Rotary inverse-frequency buffers are recomputed; a tied model's stored ``lm_head.weight``
    (some exporters write it) duplicates the embedding.
    """
    if hf_name.endswith(IGNORED_HF_SUFFIXES):
        return True
    return hf_name == "lm_head.weight" and model.tie_word_embeddings


def hf_tensor_shape(hf_name: str, model: ModelConfig) -> Tuple[int, ...]:
    """Shape of a Hugging Face tensor of ``model``; ``KeyError`` naming an unknown tensor."""
    h, f, d = model.hidden_size, model.intermediate_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_key_value_heads * d
    shapes = {
        "model.embed_tokens.weight": (model.vocab_size, h),
        "lm_head.weight": (model.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if hf_name in shapes:
        return shapes[hf_name]
    match = _HF_LAYER.match(hf_name)
    if match and int(match.group(1)) < model.num_layers:
        layer, suffix = int(match.group(1)), match.group(2)
        if any(suffix in hf for hf, _ in _layer_tensors(layer, model).values()):
            suffix = re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.{e}.", suffix)
            fm, fs = model.moe_intermediate_size, model.shared_expert_intermediate_size
            if model.family == "deepseek_v3" and suffix in deepseek.hf_shapes(model):
                return deepseek.hf_shapes(model)[suffix]
            return {
                "input_layernorm.weight": (h,),
                "post_attention_layernorm.weight": (h,),
                "self_attn.q_proj.weight": (q, h),
                "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h),
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,),
                "self_attn.q_norm.weight": (d,),
                "self_attn.k_norm.weight": (d,),
                "self_attn.o_proj.weight": (h, q),
                "mlp.gate_proj.weight": (f, h),
                "mlp.up_proj.weight": (f, h),
                "mlp.down_proj.weight": (h, f),
                "mlp.gate.weight": (model.num_experts, h),
                "mlp.experts.{e}.gate_proj.weight": (fm, h),
                "mlp.experts.{e}.up_proj.weight": (fm, h),
                "mlp.experts.{e}.down_proj.weight": (h, fm),
                "mlp.shared_expert.gate_proj.weight": (fs, h),
                "mlp.shared_expert.up_proj.weight": (fs, h),
                "mlp.shared_expert.down_proj.weight": (h, fs),
                "mlp.shared_expert_gate.weight": (1, h),
            }[suffix]
    raise KeyError(f"Hugging Face tensor {hf_name!r} is not part of a {model.num_layers}-layer {model.family} model")


def megatron_tensor_shape(name: str, model: ModelConfig) -> Tuple[int, ...]:
    """Shape of a global Megatron tensor of ``model`` (true vocabulary, TP=1)."""
    hf_names, layout = _hf_names_and_layout(name, model)
    if not hf_names:  # tied output layer
        return (model.vocab_size, model.hidden_size)
    shapes = [hf_tensor_shape(hf_name, model) for hf_name in hf_names]
    if layout == "copy":
        return shapes[0]
    return (sum(shape[0] for shape in shapes),) + shapes[0][1:]


# ----------------------------------------------------------------------------- layouts


def _check_shape(what: str, tensor: torch.Tensor, expected: Tuple[int, ...], model: ModelConfig) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"{what}: shape {tuple(tensor.shape)} does not match {tuple(expected)} "
            f"expected by the {model.family} config"
        )


def _split_qkv(qkv: torch.Tensor, model: ModelConfig) -> List[torch.Tensor]:
    groups, d = model.num_key_value_heads, model.head_dim
    per_group = model.num_attention_heads // groups
    rest = tuple(qkv.shape[1:])
    q, k, v = qkv.reshape((groups, (per_group + 2) * d) + rest).split([per_group * d, d, d], dim=1)
    return [q.reshape((-1,) + rest), k.reshape((-1,) + rest), v.reshape((-1,) + rest)]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    groups, rest = model.num_key_value_heads, tuple(q.shape[1:])
    grouped = [t.reshape((groups, -1) + rest) for t in (q, k, v)]
    return torch.cat(grouped, dim=1).reshape((-1,) + rest)


def megatron_to_hf_tensors(name: str, tensor: torch.Tensor, model: ModelConfig) -> List[Tuple[str, torch.Tensor]]:
    """Hugging Face ``(name, tensor)`` pairs of one global Megatron tensor.

    ``tensor`` has the global shape (``[V, H]`` with the true vocabulary ``V`` for the embedding
    and output layer; ``[(Nq + 2 Nkv) * D, H]`` for ``linear_qkv``; ``[2F, H]`` for
    ``linear_fc1``). Fused tensors split into fresh contiguous tensors (q/k/v in ``[N*D, H]``,
    gate/up in ``[F, H]``); renamed ones are returned as given. A tied output layer yields
    nothing. Raises ``KeyError`` for an unknown name, ``ValueError`` naming the tensor when its
    shape does not fit ``model``.
    """
    _check_shape(f"Megatron tensor {name!r}", tensor, megatron_tensor_shape(name, model), model)
    return split_rows_like(name, tensor, model)


def split_rows_like(name: str, tensor: torch.Tensor, model: ModelConfig) -> List[Tuple[str, torch.Tensor]]:
    """Hugging Face ``(name, piece)`` pairs of ``tensor``, whose rows are laid out as those of the
    global Megatron tensor ``name`` (any number of columns: the tensor itself, or a LoRA B of its
    linear): fused q/k/v or gate/up rows split into fresh contiguous pieces, a renamed tensor as
    given, nothing for a tied output layer."""
    hf_names, layout = _hf_names_and_layout(name, model)
    if not hf_names:
        return []
    if layout == "copy":
        return [(hf_names[0], tensor)]
    pieces = _split_qkv(tensor, model) if layout == "qkv" else tensor.chunk(2, dim=0)
    # Fresh storage per piece: safetensors and NCCL need tensors that share no memory.
    return [(hf_name, piece.clone(memory_format=torch.contiguous_format)) for hf_name, piece in zip(hf_names, pieces)]


def megatron_to_hf_stream(
    named_tensors: Iterable[Tuple[str, torch.Tensor]], model: ModelConfig, dtype: Optional[torch.dtype] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """A stream of global Megatron tensors as ``(hf_name, tensor)``, converted one tensor at a
    time by :func:`megatron_to_hf_tensors`, optionally cast to ``dtype`` (checkpoint export and
    the rollout weight push); the routers' correction biases stay float32, as DeepSeek's bf16
    checkpoints and SGLang's loader keep them."""
    from megatron_zcpo.megatron.weights import EXPERT_BIAS_SUFFIX

    for name, tensor in named_tensors:
        keep = dtype is None or name.endswith(EXPERT_BIAS_SUFFIX)
        for hf_name, hf_tensor in megatron_to_hf_tensors(name, tensor, model):
            yield hf_name, hf_tensor if keep else hf_tensor.to(dtype)


def hf_to_megatron_tensor(name: str, get_hf_tensor: Callable[[str], torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """One global Megatron tensor built from the Hugging Face tensors it needs.

    ``get_hf_tensor(hf_name)`` returns a Hugging Face tensor (raising ``KeyError`` when absent).
    Returns the tensor in the global shape documented in :func:`megatron_to_hf_tensors`. Raises
    ``KeyError`` naming a missing Hugging Face tensor, ``ValueError`` naming one whose shape does
    not fit ``model`` or whose dtype differs from its fusion partners.
    """
    hf_names, layout = _hf_names_and_layout(name, model)
    if not hf_names:
        raise ValueError(f"Megatron tensor {name!r} is tied to {EMBEDDING!r} and has no tensor of its own")
    pieces = []
    for hf_name in hf_names:
        try:
            tensor = get_hf_tensor(hf_name)
        except KeyError:
            raise KeyError(
                f"Hugging Face checkpoint has no tensor {hf_name!r} (needed for Megatron {name!r})"
            ) from None
        _check_shape(f"Hugging Face tensor {hf_name!r}", tensor, hf_tensor_shape(hf_name, model), model)
        pieces.append(tensor)
    if len({piece.dtype for piece in pieces}) > 1:
        raise ValueError(
            f"Hugging Face tensors {list(hf_names)} fuse into {name!r} but have dtypes "
            f"{[piece.dtype for piece in pieces]}"
        )
    if layout == "copy":
        return pieces[0]
    if layout == "qkv":
        return _fuse_qkv(*pieces, model)
    return torch.cat(pieces, dim=0)


def hf_to_megatron_tensors(
    get_hf_tensor: Callable[[str], torch.Tensor], model: ModelConfig
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every global Megatron tensor of ``model``, one at a time, from Hugging Face tensors.

    Yields ``(name, tensor)`` in :func:`megatron_tensor_names` order; see
    :func:`hf_to_megatron_tensor` for shapes and errors.
    """
    for name in megatron_tensor_names(model):
        yield name, hf_to_megatron_tensor(name, get_hf_tensor, model)
