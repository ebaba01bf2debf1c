"""Hugging Face <-> Megatron tensor names, layouts and model configs (Qwen2/Qwen2.5, Qwen3 dense, Llama).

Megatron tensors here are *global* ones, as :mod:`megatron_zcpo.megatron.weights` defines them:
local-spec names with global layer indices, TP=1 shapes, and the true (unpadded) vocabulary.
Three layouts differ from Hugging Face's:
- ``linear_qkv`` fuses q/k/v (and their biases) in megatron-core's interleaved per-query-group
  order: for each of the ``num_key_value_heads`` groups, that group's query heads, then its key
  head, then its value head;
- ``linear_fc1`` stacks SwiGLU's ``[gate_proj; up_proj]`` along the output dimension;
- tied embeddings have no ``lm_head.weight``: the output layer is the embedding.
Everything else is a rename (Qwen3's per-head ``q_norm`` / ``k_norm`` are megatron-core's
``q_layernorm`` / ``k_layernorm``). All functions take and return tensors one at a time, so a whole
model streams through them (the checkpoint tools, the rollout weight push); they work on meta
tensors too, which checks a whole checkpoint's names and shapes without reading any data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_zcpo.megatron.model import ModelConfig
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


FAMILIES: Dict[str, HFFamily] = {
    family.family: family
    for family in (
        HFFamily("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True),
        # Qwen3's attention_bias would also put a bias on o_proj: refused, so fixed at False.
        HFFamily("qwen3", "qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_layernorm=True,
                 required=("head_dim",)),
        HFFamily("llama", "llama", "LlamaForCausalLM", qkv_bias=None),
    )
}

# config.json fields without which the architecture is unknown.
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "max_position_embeddings")

# Per layer: Megatron suffix -> (Hugging Face suffixes, layout).
_LAYER_TENSORS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "copy"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "copy"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "copy"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "copy"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "copy"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "copy"),
}
_MODEL_TENSORS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    EMBEDDING: (("model.embed_tokens.weight",), "copy"),
    FINAL_NORM: (("model.norm.weight",), "copy"),
    OUTPUT_LAYER: (("lm_head.weight",), "copy"),
}
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# config.json fields that mean mixture-of-experts layers (dense models only convert).
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

# Hugging Face tensors that carry no weights Megatron needs (old Llama checkpoints store the
# rotary inverse frequencies, which both sides recompute from rope_theta).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- model configs


def _family_of(config: dict) -> HFFamily:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    supported = {f.model_type: f for f in FAMILIES.values()}
    moe = [key for key in _MOE_FIELDS if config.get(key)]
    if moe or str(model_type).endswith("_moe") or any("Moe" in a for a in architectures):
        raise ValueError(f"config.json model_type={model_type!r} (architectures={architectures}, fields {moe}): "
                         f"mixture-of-experts models are not supported; only dense models convert")
    if model_type is None:
        raise KeyError(f"config.json has no 'model_type' (architectures={architectures}); "
                       f"supported: {sorted(supported)}")
    family = supported.get(model_type)
    if family is None:
        raise ValueError(f"config.json model_type={model_type!r} (architectures={architectures}) is not "
                         f"supported; supported model types: {sorted(supported)}")
    for architecture in architectures:
        if architecture != family.architecture:
            raise ValueError(f"config.json architectures={architectures}: model_type {model_type!r} "
                             f"is converted as {family.architecture}, not {architecture}")
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
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={config['hidden_act']!r}: only SwiGLU (silu) MLPs convert")
    if config.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=True: MLP biases are not supported")
    if family.qkv_bias is not True and config.get("attention_bias"):
        # Llama's and Qwen3's attention_bias also put a bias on o_proj, which the Megatron model lacks.
        raise ValueError(f"config.json attention_bias=True: {family.architecture} then has a bias on o_proj, "
                         f"which is not supported")
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
    model = ModelConfig(
        family=family.family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        max_position_embeddings=int(config["max_position_embeddings"]),
        rope_theta=theta,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias if family.qkv_bias is not None else bool(config.get("attention_bias", False)),
        qk_layernorm=family.qk_layernorm,
        rope_scaling=scaling,
        init_method_std=float(config.get("initializer_range", 0.02)),
    )
    model.validate(prefix="config.json")
    return model


def hf_config_from_model_config(model: ModelConfig, base: Optional[dict] = None) -> dict:
    """A Hugging Face ``config.json`` dict for ``model``.

    ``base`` (e.g. the original config.json) supplies every field the model does not determine
    (token ids, dtype, transformers version, ...) and the rope style: transformers>=5
    ``rope_parameters`` when ``base`` has it, else ``rope_theta`` + ``rope_scaling``. Raises
    ``ValueError`` when ``base`` belongs to another family or the model cannot be expressed.
    """
    family = FAMILIES[model.family]
    if base is not None and base.get("model_type", family.model_type) != family.model_type:
        raise ValueError(f"base config model_type={base.get('model_type')!r} does not match "
                         f"family {model.family!r} ({family.model_type})")
    config = dict(base) if base is not None else {
        "architectures": [family.architecture], "model_type": family.model_type, "hidden_act": "silu"}
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
    if ("head_dim" in config or "head_dim" in family.required
            or model.head_dim != model.hidden_size // model.num_attention_heads):
        config["head_dim"] = model.head_dim
    if family.qkv_bias is not None and bool(model.qkv_bias) != family.qkv_bias:
        raise ValueError(f"model.qkv_bias={model.qkv_bias}: {family.architecture} always has "
                         f"qkv_bias={family.qkv_bias}")
    if family.qkv_bias is not True:
        config["attention_bias"] = bool(model.qkv_bias)
    if bool(model.qk_layernorm) != family.qk_layernorm:
        raise ValueError(f"model.qk_layernorm={model.qk_layernorm}: {family.architecture} always has "
                         f"qk_layernorm={family.qk_layernorm}")
    scaling = dict(model.rope_scaling) if model.rope_scaling else None
    if "rope_parameters" in config:
        config["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": model.rope_theta}
    else:
        config["rope_theta"] = model.rope_theta
        if scaling is not None or "rope_scaling" in config:
            config["rope_scaling"] = scaling
    return config


# ----------------------------------------------------------------------------- tensor names


def _has_layer_tensor(suffix: str, model: ModelConfig) -> bool:
    """Whether a layer of ``model`` has the Megatron tensor ``suffix`` (biases, q/k norms are optional)."""
    if suffix.endswith(".bias"):
        return bool(model.qkv_bias)
    if suffix.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return bool(model.qk_layernorm)
    return True


def megatron_tensor_names(model: ModelConfig) -> List[str]:
    """Global Megatron tensor names of ``model`` in model order (no output layer when tied)."""
    names = [EMBEDDING]
    for layer in range(model.num_layers):
        names.extend(f"decoder.layers.{layer}.{suffix}" for suffix in _LAYER_TENSORS
                     if _has_layer_tensor(suffix, model))
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
    if match and match.group(2) in _LAYER_TENSORS and int(match.group(1)) < model.num_layers:
        if not _has_layer_tensor(match.group(2), model):
            raise KeyError(f"Megatron tensor {name!r}: the model has no such tensor "
                           f"(qkv_bias={model.qkv_bias}, qk_layernorm={model.qk_layernorm})")
        hf_suffixes, layout = _LAYER_TENSORS[match.group(2)]
        return tuple(f"model.layers.{match.group(1)}.{suffix}" for suffix in hf_suffixes), layout
    raise KeyError(f"Megatron tensor {name!r} has no Hugging Face counterpart in a "
                   f"{model.num_layers}-layer {model.family} model")


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
    layer_shapes = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
    }
    if match and match.group(2) in layer_shapes and int(match.group(1)) < model.num_layers:
        return layer_shapes[match.group(2)]
    raise KeyError(f"Hugging Face tensor {hf_name!r} is not part of a {model.num_layers}-layer "
                   f"{model.family} model")


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
        raise ValueError(f"{what}: shape {tuple(tensor.shape)} does not match {tuple(expected)} "
                         f"expected by the {model.family} config")


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
    hf_names, layout = _hf_names_and_layout(name, model)
    _check_shape(f"Megatron tensor {name!r}", tensor, megatron_tensor_shape(name, model), model)
    if not hf_names:
        return []
    if layout == "copy":
        return [(hf_names[0], tensor)]
    pieces = _split_qkv(tensor, model) if layout == "qkv" else tensor.chunk(2, dim=0)
    # Fresh storage per piece: safetensors and NCCL need tensors that share no memory.
    return [(hf_name, piece.clone(memory_format=torch.contiguous_format))
            for hf_name, piece in zip(hf_names, pieces)]


def megatron_to_hf_stream(named_tensors: Iterable[Tuple[str, torch.Tensor]], model: ModelConfig,
                          dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """A stream of global Megatron tensors as ``(hf_name, tensor)``, converted one tensor at a
    time by :func:`megatron_to_hf_tensors`, optionally cast to ``dtype`` (checkpoint export and
    the rollout weight push)."""
    for name, tensor in named_tensors:
        for hf_name, hf_tensor in megatron_to_hf_tensors(name, tensor, model):
            yield hf_name, hf_tensor if dtype is None else hf_tensor.to(dtype)


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
            raise KeyError(f"Hugging Face checkpoint has no tensor {hf_name!r} "
                           f"(needed for Megatron {name!r})") from None
        _check_shape(f"Hugging Face tensor {hf_name!r}", tensor, hf_tensor_shape(hf_name, model), model)
        pieces.append(tensor)
    if len({piece.dtype for piece in pieces}) > 1:
        raise ValueError(f"Hugging Face tensors {list(hf_names)} fuse into {name!r} but have dtypes "
                         f"{[piece.dtype for piece in pieces]}")
    if layout == "copy":
        return pieces[0]
    if layout == "qkv":
        return _fuse_qkv(*pieces, model)
    return torch.cat(pieces, dim=0)


def hf_to_megatron_tensors(get_hf_tensor: Callable[[str], torch.Tensor], model: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every global Megatron tensor of ``model``, one at a time, from Hugging Face tensors.

    Yields ``(name, tensor)`` in :func:`megatron_tensor_names` order; see
    :func:`hf_to_megatron_tensor` for shapes and errors.
    """
    for name in megatron_tensor_names(model):
        yield name, hf_to_megatron_tensor(name, get_hf_tensor, model)
