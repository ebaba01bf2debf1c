"""LoRA adapters as a Hugging Face PEFT folder: tensor names, layouts and ``adapter_config.json``.

The Megatron side is the global adapters of :mod:`megatron_zcpo.megatron.weights` (part
"adapters": ``decoder.layers.{i}.self_attention.linear_qkv_lora.lora_a`` [r, in] and ``.lora_b``
[out, r], TP=1 shapes). A fused Megatron linear has one adapter: its A is shared by the Hugging
Face projections it fuses (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) and its
B is split by rows like the fused weight (:func:`~megatron_zcpo.convert.mapping.split_rows_like`),
so each projection's B A is exactly its rows of the fused update. The folder is what PEFT's
``PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read: ``adapter_config.json`` and
``adapter_model.safetensors`` with keys ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_zcpo.convert.mapping import hf_names_of, megatron_tensor_shape, split_rows_like
from megatron_zcpo.megatron.lora import LoraConfig, adapted_weight_name
from megatron_zcpo.megatron.model import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Megatron target -> the Hugging Face projections it fuses (PEFT's and SGLang's target module names).
HF_TARGET_MODULES: Dict[str, Tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def hf_target_modules(lora: LoraConfig) -> List[str]:
    """The Hugging Face module names ``lora`` adapts (PEFT's ``target_modules``, SGLang's ``--lora-target-modules``)."""
    return [module for target in lora.targets for module in HF_TARGET_MODULES[target]]


def peft_adapter_config(lora: LoraConfig, base_model: Optional[str] = None) -> dict:
    """``adapter_config.json`` of ``lora``'s adapters on the base ``base_model`` (a path or hub name)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": hf_target_modules(lora),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def megatron_adapter_to_peft(name: str, tensor: torch.Tensor, model: ModelConfig) -> List[Tuple[str, torch.Tensor]]:
    """PEFT ``(key, tensor)`` pairs of one global Megatron adapter tensor (module docstring).

    Raises ``ValueError`` naming the tensor when it is not an adapter of ``model`` or its
    non-rank dimension does not fit the adapted weight."""
    weight = adapted_weight_name(name)
    rows, columns = megatron_tensor_shape(weight, model)
    is_a = name.endswith("lora_a")
    if tensor.dim() != 2 or (tensor.shape[1] != columns if is_a else tensor.shape[0] != rows):
        expected = f"[r, {columns}]" if is_a else f"[{rows}, r]"
        raise ValueError(f"adapter {name!r}: shape {tuple(tensor.shape)}, expected {expected} for {weight!r}")
    matrix = "lora_A" if is_a else "lora_B"
    if is_a:  # the fused projections share A: one copy each
        pieces = [(hf_name, tensor.clone()) for hf_name in hf_names_of(weight, model)]
    else:
        pieces = split_rows_like(weight, tensor, model)
    return [(f"{PEFT_PREFIX}{hf_name[: -len('.weight')]}.{matrix}.weight", piece) for hf_name, piece in pieces]


def megatron_adapters_to_peft_stream(
    named_tensors: Iterable[Tuple[str, torch.Tensor]], model: ModelConfig, dtype: Optional[torch.dtype] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """A stream of global Megatron adapter tensors as PEFT ``(key, tensor)``, optionally cast to ``dtype``."""
    for name, tensor in named_tensors:
        for key, piece in megatron_adapter_to_peft(name, tensor, model):
            yield key, piece if dtype is None else piece.to(dtype)


def write_peft_adapter(
    directory: str | os.PathLike, named_peft_tensors: Iterable[Tuple[str, torch.Tensor]], config: dict
) -> int:
    """Write a PEFT folder (``adapter_config.json`` = ``config``, ``adapter_model.safetensors``) into
    ``directory`` (created); returns the bytes of the tensors written."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {key: tensor.detach().cpu().contiguous() for key, tensor in named_peft_tensors}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(directory / ADAPTER_CONFIG, "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
