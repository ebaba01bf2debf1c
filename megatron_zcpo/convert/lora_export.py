"""A LoRA training checkpoint out of the trainer: a PEFT folder, or its adapters merged into a whole Hugging Face model.

A LoRA checkpoint's ``weights/`` holds the adapters (and their optimizer state) and ``lora.json``
(:mod:`megatron_zcpo.checkpoint.lora_base`: the adapters' config and the base by path and
fingerprint). :func:`export_peft` writes the adapters as a PEFT folder for the base
(:mod:`megatron_zcpo.convert.peft`); :func:`merge_into_hf` streams the base (a Hugging Face
directory or a Megatron checkpoint) one tensor at a time, replaces each adapted weight by
W + (alpha/r) B A (in fp32, cast to the stored dtype, as the merged weight push does) and writes a
Hugging Face directory, whole or not at all. The base must be the one the adapters were trained on:
its fingerprint is checked against the record (a randomly initialised base has none: not checked).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch

from megatron_zcpo.checkpoint.lora_base import base_fingerprint, read_lora_record
from megatron_zcpo.convert import hf_checkpoint, mapping
from megatron_zcpo.convert.checkpoint import (
    hf_files_of,
    megatron_checkpoint_dir,
    read_checkpoint_tensors,
    require_megatron_checkpoint,
)
from megatron_zcpo.convert.output_dir import atomic_output_dir
from megatron_zcpo.megatron.lora import LoraConfig, adapted_weight_name
from megatron_zcpo.megatron.model import ModelConfig


def lora_checkpoint(path: str | os.PathLike) -> Optional[Tuple[Path, dict]]:
    """(``weights/`` directory, its LoRA record) when ``path`` (a training step, checkpoint or run
    directory, as :func:`~megatron_zcpo.convert.checkpoint.megatron_checkpoint_dir` takes it) holds
    LoRA adapters only; None for a whole model."""
    weights = megatron_checkpoint_dir(path)
    record = read_lora_record(weights) if weights is not None else None
    return (weights, record) if record is not None else None


def read_adapters(weights: Path, record: dict, model: ModelConfig) -> Dict[str, torch.Tensor]:
    """The global adapters of a LoRA checkpoint's ``weights/`` ({name: tensor}, TP=1, stored dtype).
    Needs :func:`setup_megatron` in a single process."""
    return dict(read_checkpoint_tensors(weights, model, LoraConfig(**record["config"])))


def resolve_base(record: dict, base: Optional[str | os.PathLike]) -> Path:
    """The base to merge into: ``base`` or the record's path; ``ValueError`` naming both when it is not
    the base the adapters were trained on (its fingerprint differs), ``FileNotFoundError`` when none is found."""
    stored = record.get("base") or {}
    path = Path(base) if base is not None else Path(stored["path"]) if stored.get("path") else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            f"the adapters' base {path or '(none recorded: a randomly initialised base)'} is not there: pass --base DIR"
        )
    if stored.get("fingerprint") and base_fingerprint(path) != stored["fingerprint"]:
        raise ValueError(
            f"--base {path} is not the base the adapters were trained on ({stored.get('path')}: its fingerprint "
            f"{stored['fingerprint'][:16]}... differs)"
        )
    return path


def _base_tensors(base: Path, model: ModelConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base's global Megatron tensors, one at a time: from a Megatron checkpoint or a Hugging Face directory."""
    checkpoint = megatron_checkpoint_dir(base)
    if checkpoint is not None:
        yield from read_checkpoint_tensors(checkpoint, model)
        return
    with hf_checkpoint.SafetensorsCheckpoint(base) as source:
        yield from mapping.hf_to_megatron_tensors(source.tensor, model)


def merged_tensors(
    base: Path, adapters: Dict[str, torch.Tensor], lora: LoraConfig, model: ModelConfig
) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base's global tensors with every adapted weight replaced by W + (alpha/r) B A (fp32, cast to W's dtype)."""
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        pairs.setdefault(adapted_weight_name(name), {})[name.rsplit(".", 1)[-1]] = tensor
    for name, tensor in _base_tensors(base, model):
        pair = pairs.pop(name, None)
        if pair is not None:
            delta = pair["lora_b"].float() @ pair["lora_a"].float()
            tensor = (tensor.float() + lora.scaling * delta).to(tensor.dtype)
        yield name, tensor
    if pairs:
        raise KeyError(f"adapters of {sorted(pairs)} have no weight in the base: another architecture?")


def merge_into_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base: Optional[str | os.PathLike] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = hf_checkpoint.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    hf_files: Optional[str | os.PathLike] = None,
) -> ModelConfig:
    """Write a LoRA checkpoint's adapters merged into their base as a Hugging Face directory ``out_dir``
    (safetensors shards, config.json, the tokenizer files of ``hf_files`` / the base's / the run's).
    ``base``: default the recorded base path (checked by fingerprint, :func:`resolve_base`). Needs
    :func:`setup_megatron` in a single process. Returns the model config."""
    from megatron_zcpo.checkpoint.io import read_model_config

    found = lora_checkpoint(checkpoint)
    if found is None:
        raise ValueError(f"{checkpoint} holds a whole model, not LoRA adapters: convert it without merging")
    weights, record = found
    model, lora = read_model_config(weights), LoraConfig(**record["config"])
    base_path = resolve_base(record, base)
    adapters = read_adapters(weights, record, model)
    files = Path(hf_files) if hf_files else hf_files_of(base_path) or (base_path if _is_hf(base_path) else None)
    config_base = (
        hf_checkpoint.read_hf_config(files) if files and (files / hf_checkpoint.CONFIG_FILE).is_file() else None
    )
    with atomic_output_dir(out_dir, overwrite=overwrite, source=weights) as out:
        stream = mapping.megatron_to_hf_stream(merged_tensors(base_path, adapters, lora, model), model, dtype)
        hf_checkpoint.write_safetensors_shards(out, stream, max_shard_bytes)
        hf_checkpoint.write_hf_config(out, mapping.hf_config_from_model_config(model, config_base))
        if files is not None:
            hf_checkpoint.copy_hf_assets(files, out)
    return model


def _is_hf(path: Path) -> bool:
    return (path / hf_checkpoint.CONFIG_FILE).is_file()


def export_peft(
    checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> Tuple[ModelConfig, int]:
    """Write a LoRA checkpoint's adapters as a PEFT folder ``out_dir`` (``adapter_config.json`` naming the
    recorded base, ``adapter_model.safetensors``); returns (model config, bytes written). Needs
    :func:`setup_megatron` in a single process."""
    from megatron_zcpo.checkpoint.io import read_model_config
    from megatron_zcpo.convert.peft import megatron_adapters_to_peft_stream, peft_adapter_config, write_peft_adapter

    found = lora_checkpoint(require_megatron_checkpoint(checkpoint))
    if found is None:
        raise ValueError(f"{checkpoint} holds a whole model, not LoRA adapters")
    weights, record = found
    model, lora = read_model_config(weights), LoraConfig(**record["config"])
    adapters = read_adapters(weights, record, model)
    config = peft_adapter_config(lora, (record.get("base") or {}).get("path"))
    with atomic_output_dir(out_dir, overwrite=overwrite, source=weights) as out:
        written = write_peft_adapter(out, megatron_adapters_to_peft_stream(adapters.items(), model), config)
    return model, written
